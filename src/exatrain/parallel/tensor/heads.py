"""Attention written the usual ways, under a tensor split: head-count attributes made local.

Attention code reshapes with its own head count: nanoGPT's `self.n_head`, Hugging Face's
`self.num_heads` / `self.num_key_value_heads` with `self.head_dim`, torchtitan's `self.n_heads` /
`self.n_kv_heads`. When the q/k/v → out pair of such a module is split over `split` ranks, each
rank holds `heads / split` whole heads, so these attributes are set to the local counts (and a
pair whose head counts do not divide is left whole, see convert._fits_pair).

Code that also derives the head size from the *full* width (nanoGPT's `C // self.n_head` with
`C = x.size(-1)`) cannot run on a local slice. That is found before training: the split module
runs once on a zero input (1D plans; no gradient, its own row all-reduce of 4·2·d bytes on the
tensor axis) and a failing reshape becomes an error naming the module, the attribute and the fix.
"""

from __future__ import annotations

import re

import torch
import torch.distributed
from torch import nn

_SHAPE_ERROR = re.compile(r"shape|size|view|dimension", re.IGNORECASE)

HEAD_COUNT_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads",
                         "n_kv_head", "n_kv_heads", "num_key_value_heads")


def head_counts(module: nn.Module) -> dict[str, int]:
    """The module's integer head-count attributes."""
    out = {}
    for name in HEAD_COUNT_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    return out


def heads_divide(module: nn.Module, split: int) -> bool:
    return all(v % split == 0 for v in head_counts(module).values())


def localize_heads(module: nn.Module, split: int) -> dict[str, tuple[int, int]]:
    """Set every head-count attribute to its per-rank value; returns {attr: (full, local)}."""
    changed = {}
    for name, value in head_counts(module).items():
        setattr(module, name, value // split)
        changed[name] = (value, value // split)
    return changed


def check_runs_split(name: str, module: nn.Module, changed: dict, in_features: int,
                     split: int, device, dtype) -> None:
    """Run the split attention once on zeros; a failing reshape is refused with the fix."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            module(torch.zeros(1, 2, in_features, device=device, dtype=dtype))
    except TypeError:
        return  # needs more arguments (masks, positions) than a probe can guess: trust it
    except RuntimeError as exc:
        if not _SHAPE_ERROR.search(str(exc)) or isinstance(exc, torch.distributed.DistError):
            raise  # not a reshape: a communication failure or a real bug, shown as it is
        attrs = ", ".join(f"self.{a} = {local} (of {full})" for a, (full, local) in changed.items()) \
            or "no head-count attribute"
        raise ValueError(
            f"tensor parallelism splits the attention {name or '<root>'} "
            f"({type(module).__name__}) over {split} ranks, each holding 1/{split} of its heads "
            f"({attrs}), and its forward then fails: {exc}. It probably reshapes with the full "
            f"width (e.g. `C // self.n_head` with C = x.size(-1)). Fix: reshape with the head "
            f"count and -1, e.g. `q.view(B, T, self.n_head, -1)` and `y.reshape(B, T, -1)`, or "
            f"store the head size (`self.head_dim`) and use it.") from None
    finally:
        module.train(was_training)
