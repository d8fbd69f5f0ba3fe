"""What a user's data sets hold, checked before the first step: a map-style data set of samples
`(input, target)` (`check_map_style`, `check_sample`), or batches made by the user's collate_fn
(`check_collated`) and where such batches cannot go (`collate_refusal`); `shape_of` describes a
value in a few words for the messages. No communication; each reads a sample or two.
"""

from __future__ import annotations

from typing import Callable

from ..errors import DataError


def shape_of(value) -> str:
    """One sample's structure in a few words: 'Tensor (4, 8) float32', "dict ['a', 'y']"."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, np.ndarray):
        return f"ndarray {value.shape} {value.dtype}"
    if isinstance(value, dict):
        return f"dict with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)} ({', '.join(map(shape_of, value))})"
    return type(value).__name__


def check_map_style(name: str, data_set) -> None:
    """Refuse, naming the fix, a data set exatrain cannot sample by index: each rank reads
    its own share of every batch (`__getitem__`), and epochs and steps are counted from
    `__len__`."""
    from torch.utils.data import IterableDataset

    iterable = isinstance(data_set, IterableDataset)   # (its __getitem__ is Dataset's, unusable)
    if not iterable and hasattr(data_set, "__getitem__") and hasattr(data_set, "__len__"):
        return
    if data_set is None and name == "val_set":
        raise DataError(
            "val_set is None: training evaluates on a validation set every train.eval_every "
            "steps and at the end (the summary's val_loss). Hold out part of your data: "
            "`train_set, val_set = torch.utils.data.random_split(data, [0.9, 0.1], "
            "generator=torch.Generator().manual_seed(0))`.")
    kind = "an iterable-style data set" if iterable or hasattr(data_set, "__iter__") \
        else "not a data set"
    raise DataError(
        f"{name} is {type(data_set).__name__} ({kind}): exatrain reads samples by index, each "
        f"rank its share of every batch, so it needs a map-style Dataset, with __getitem__ "
        f"(one sample, (input, target)) and __len__, e.g. torch.utils.data.TensorDataset(x, y).")


def collate_refusal(plan, config) -> str | None:
    """Why a collate_fn's batches (graphs of different sizes: no dim of every input runs over
    the samples) cannot go where `plan` and `config` would take them (with the fix), or None."""
    why = []
    if plan.pipe > 1:
        why.append(f"pipe={plan.pipe} cuts every input into micro-batches along dim 0")
    if plan.space_degree > 1:
        why.append(f"space={tuple(plan.space)} cuts every input into spatial blocks")
    if plan.tensor_3d and plan.tensor[2] > 1:
        why.append(f"tensor={tuple(plan.tensor)} scatters every input's rows over tensor_z")
    if config.parallel.branches != "none":
        why.append(f"parallel.branches={config.parallel.branches!r} gathers the branches' "
                   f"inputs along dim 0, of equal sizes on every rank")
    if config.optim.name == "kfac":
        why.append("optim.name='kfac' counts a layer's input rows as samples (nodes, here)")
    if not why:
        return None
    return (f"a collate_fn's batches (graphs of different sizes) have no dim that runs over the "
            f"samples in every input, and {'; '.join(why)}. Data, shard and 1D tensor "
            f"parallelism (plan.tensor=N) train them, each rank collating its share of every "
            f"batch; with AdamW or SGD.")


def _tensors_only(value) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return all(_tensors_only(v) for v in value)
    if isinstance(value, dict):
        return all(_tensors_only(v) for v in value.values())
    return False


def check_collated(name: str, data_set, collate_fn: Callable) -> None:
    """Refuse, before any step, a `collate_fn` whose batch of the set's first two samples is not
    `(input, target)` with a target of one row per sample: evaluation counts, weighs and cuts
    its batches by the target's rows (a target per node of a graph would be counted as
    samples)."""
    import torch

    import numpy as np

    n = min(2, len(data_set))
    if n == 0:
        return
    with torch.random.fork_rng(devices=[]):
        state = np.random.get_state()
        try:
            batch = collate_fn([data_set[i] for i in range(n)])
        finally:
            np.random.set_state(state)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2) or not _tensors_only(batch[0]):
        raise DataError(f"collate_fn on {name}[0:{n}] returned {shape_of(batch)}; training calls "
                        f"model(input) and loss(output, target): return (input, target), the "
                        f"input a tensor or a tuple, list or dict of them (which exatrain moves "
                        f"to the device; a batch object's tensors as a dict).")
    target = batch[1]
    if not isinstance(target, torch.Tensor) or target.dim() == 0 or len(target) != n:
        raise DataError(f"collate_fn on {name}[0:{n}] returned a target {shape_of(target)}: "
                        f"exatrain counts a batch's samples by its target's rows, so the target "
                        f"needs one row per sample ({n} here), e.g. a value per graph. A target "
                        f"per node is not supported with collate_fn: pad the graphs to one size "
                        f"and stack them instead.")


def check_sample(name: str, data_set) -> None:
    """Refuse, before any step, a data set whose samples are not `(input, target)`: the input one
    tensor, or a tuple, list or dict of them (a model of several inputs), the target one tensor
    or a number. The Trainer calls `model(input)` (`model(*inputs)`, `model(**inputs)`:
    parallel.nested.call_on) and `loss(output, target)` on batches of them, moved to the device
    as tensors. Reads the set's first sample (under space with block reads, this rank's block),
    leaving the global random streams as they were (an augmentation may draw from them); an
    empty set, or one that reads only batches (`__getitems__`), is left to the loader."""
    import numbers

    import numpy as np
    import torch

    if len(data_set) == 0:
        return
    try:
        with torch.random.fork_rng(devices=[]):
            state = np.random.get_state()
            sample = data_set[0]
            np.random.set_state(state)
    except NotImplementedError:   # torch's Dataset.__getitem__: a set that reads only batches
        return                    # (__getitems__), which the loader calls: not checked here
    arrays = (torch.Tensor, np.ndarray, np.generic)
    several = (tuple, list, dict)

    def inputs(value) -> bool:   # one tensor, or a tuple, list or dict of tensors
        if isinstance(value, dict):
            return bool(value) and all(isinstance(k, str) and isinstance(v, arrays)
                                       for k, v in value.items())
        if isinstance(value, (tuple, list)):
            return bool(value) and all(isinstance(v, arrays) for v in value)
        return isinstance(value, arrays)

    pair = isinstance(sample, (tuple, list)) and len(sample) == 2
    if pair and inputs(sample[0]) and isinstance(sample[1], (*arrays, numbers.Number)):
        return
    fix = "return `input, target` from __getitem__, each one tensor"
    if pair and isinstance(sample[0], several):
        fix += (" (a model of several inputs: `(x, p), target` or `{'x': x, 'p': p}, target`, "
                "each input a tensor, which the model takes as model(x, p) or model(x=x, p=p))")
    elif isinstance(sample, (tuple, list)) and len(sample) > 2 and \
            all(isinstance(v, arrays) for v in sample):
        names = ", ".join(f"x{i}" for i in range(len(sample) - 1))
        fix += (f" (a model of several inputs: return `({names}), target`, the inputs in a "
                f"tuple, which the model takes as model({names}))")
    elif pair and isinstance(sample[1], several):
        fix += " (several targets: concatenate them into one tensor and split it in the loss)"
    elif isinstance(sample, dict):
        fix += " (e.g. `return d['x'], d['y']` instead of the dict)"
    raise DataError(f"{name}[0] is {shape_of(sample)}; exatrain trains on (input, target) "
                    f"pairs, calling model(input) and loss(output, target): {fix}.")
