"""Workloads written by the user: a Task (model, data sets, loss, metrics), and the entry point
`run.workload = "package.module:build"` or `"path/to/file.py:build"` (`:build` may be left out of
a file path, which then must define `build`).

The named function receives its options from the config's [model] and [data] sections. It
declares them in its signature, so a typo is still an error that names the closest key:

    @dataclass
    class DataOptions:
        path: str = "volumes.h5"

    def build(data: DataOptions, channels: int = 16, depth: int = 2, mesh=None) -> exatrain.Task:
        ...

  * a parameter `data` (or `model`) annotated with a dataclass (or defaulting to one of its
    instances) takes that section, checked against the dataclass fields;
  * every other parameter with a default is a key of [model];
  * a parameter named `mesh` receives the live Mesh (for rank-dependent reading).

The function returns a `Task` (or a dict with its fields).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn
from torch.utils.data import Dataset

from .base import Workload
from .metrics import Mean, metric_functions
from .samples import check_collated, check_map_style, check_sample, shape_of
from ..errors import ConfigError, DataError, LossError


@dataclass
class Task:
    """What a user hands exatrain: a plain model, map-style data sets, a loss, named metrics.

    `loss(output, target)` returns the batch-mean loss; `metrics` maps names to a callable
    (a Mean of its values), `exatrain.Mean` or `exatrain.Ratio`; they appear as `val_<name>`.
    `val_loss` is always reported. `baselines` are copied into the run summary.
    `train_set` and `val_set` are map-style Datasets of `(input, target)`; `flops_per_sample`
    (training FLOPs of one sample, 0 if unknown) turns on `mfu` and `model_flops_per_s`.
    `collate_fn` (as DataLoader's) makes a batch `(input, target)` of a list of samples that do
    not stack (graphs of different sizes); the target has a row per sample.
    """
    model: nn.Module
    train_set: Dataset
    val_set: Dataset
    loss: Callable
    metrics: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)
    flops_per_sample: float = 0.0
    collate_fn: Callable | None = None


def workload_from_task(task: Task, mesh=None) -> Workload:
    """The Workload of a user's Task on `mesh`. Under `space`, data sets with
    `read(index, region)` are read by blocks (`read_by_blocks`); others deliver whole samples."""
    for name in ("train_set", "val_set"):
        check_map_style(name, getattr(task, name))
    if not isinstance(task.model, nn.Module):
        raise TypeError(f"Task.model must be a torch.nn.Module, got {type(task.model).__name__}")
    model, compiled = uncompiled(task.model)
    metrics = {"loss": Mean(task.loss), **task.metrics}
    metric_sums, finalize = metric_functions(metrics)
    train_set, val_set = task.train_set, task.val_set
    blocks = mesh is not None and mesh.plan.space_degree > 1 and reads_blocks(train_set, val_set)
    if blocks:
        train_set, val_set = read_by_blocks(train_set, mesh), read_by_blocks(val_set, mesh)
    for name, ds in (("train_set", train_set), ("val_set", val_set)):
        if task.collate_fn is None:
            check_sample(name, ds)
        else:
            check_collated(name, ds, task.collate_fn)
    return Workload(model=model, train_set=train_set, val_set=val_set,
                    loss_fn=OneValueLoss(task.loss), metric_sums=metric_sums, finalize=finalize,
                    baselines=dict(task.baselines), flops_per_sample=task.flops_per_sample,
                    input_blocks=blocks, whole_outputs=True, compile=compiled,
                    collate_fn=task.collate_fn)


def uncompiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The plain module of a model the user compiled (`torch.compile(model)`), and whether it
    was compiled. The compiled wrapper runs the module it was given: a layout that replaces
    layers (tensor) or traces the forward (pipe) must see the plain module, and compile after."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return model._orig_mod, True
    return model, False


class OneValueLoss:
    """The user's training loss, refused by name when it returns what a backward cannot start
    from (a loss with reduction="none" failed in the backward with PyTorch's "grad can be
    implicitly created only for scalar outputs"). Evaluation averages per-sample values
    itself (`Mean`) and calls the loss unchecked."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, output, target):
        import torch

        value = self.fn(output, target)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise LossError(f"the loss returned {shape_of(value)}; training starts its backward "
                            "from one value, the batch-mean loss: keep the loss's default "
                            "reduction='mean' (not 'none'), or return loss.mean().")
        return value


def summed_over_samples(model: nn.Module, loss: Callable, x, y) -> tuple | None:
    """(the loss of two samples, of the first, of the second) when `loss` adds over the samples
    of a batch (reduction="sum") instead of averaging them: its value on both equals the sum of
    its values on each, not their mean. One forward of the two samples, in evaluation mode
    (samples independent: no dropout, BatchNorm on its running statistics), without gradients,
    leaving no trace in the model; each sample's loss takes its rows of the outputs (a 0-dim
    auxiliary output is kept whole). `x`, `y`: the batch of exactly those two samples (a
    collate_fn's graphs whole). None when the loss averages, or when this fails (training then
    says why)."""
    import torch

    from ..parallel.nested import call_on, map_tensors
    from ..parallel.trial import probing

    def rows(out, part: slice):
        return map_tensors(out, lambda t: t[part] if t.dim() and len(t) == 2 else t)

    try:
        with probing(model), torch.no_grad():
            out = call_on(model, x)   # the first two samples (a collate_fn's graphs whole)
            both, first, second = (float(loss(rows(out, part), y[part]))
                                   for part in (slice(0, 2), slice(0, 1), slice(1, 2)))
    except Exception:  # noqa: BLE001 - the training forward reports it, where it belongs
        return None
    total, mean = first + second, (first + second) / 2
    if abs(both - total) <= 1e-4 * abs(total) and abs(both - mean) > 1e-3 * abs(mean):
        return both, first, second
    return None


def float64_input_error(x, exc: RuntimeError) -> DataError | None:
    """The user error behind a forward that failed on a float64 input (NumPy's default) into
    float32 (or bf16) weights; None for any other failure. A model that converts its input
    itself (x.float()) never gets here."""
    import torch

    failure = exc
    if exc.__cause__ is not None:   # a pipeline stage wraps its forward's failure in its own;
        if "failed to run forward" not in str(exc):   # a backward's (a float64 target) is not
            return None                               # the input's
        failure = exc.__cause__
    from ..parallel.nested import tensors_of

    if any(t.dtype == torch.float64 for t in tensors_of(x)) and "double" in str(failure).lower():
        return DataError(
            f"the model's input is float64 (NumPy's default) and its forward failed on it "
            f"({str(failure).strip().splitlines()[0]}): return the input in float32 from __getitem__ "
            f"(x.astype(np.float32), or torch.from_numpy(x).float()).")
    return None


@contextlib.contextmanager
def float64_input_named(x):
    """Around a forward on `x`: its failure on NumPy's float64 into float32 weights is raised as
    `float64_input_error`'s DataError; any other failure passes through as it is."""
    try:
        yield
    except RuntimeError as exc:
        if (error := float64_input_error(x, exc)) is not None:
            raise error from exc
        raise


# ---------------------------------------------------------------------------- reading by blocks
def reads_blocks(train_set, val_set) -> bool:
    """Whether a user's data sets can read blocks: both have `read(index, region)` (the block
    protocol) and `sample_shape` (one input's (C, *spatial) shape, to place the blocks in).
    One of them alone is refused: the model takes blocks or whole samples, not both."""
    able = {name: callable(getattr(ds, "read", None))
            for name, ds in (("train_set", train_set), ("val_set", val_set))}
    if not any(able.values()):
        return False
    if not all(able.values()):
        have, lack = (n for n in able if able[n]), (n for n in able if not able[n])
        raise TypeError(
            f"{next(have)} reads blocks (it has read(index, region)) but {next(lack)} does not: "
            f"under space the model takes either each rank's block of every sample or whole "
            f"samples. Give both a read(index, region) (e.g. both et.data.HDF5Dataset), or "
            f"neither.")
    for name, ds in (("train_set", train_set), ("val_set", val_set)):
        shape = getattr(ds, "sample_shape", None)
        if not (isinstance(shape, tuple) and len(shape) >= 2):
            raise TypeError(
                f"{name} ({type(ds).__name__}) has read(index, region) but no sample_shape: give "
                f"it a `sample_shape` attribute, the shape of one input as the model takes it "
                f"(C, *spatial), e.g. (2, 64, 64, 64), so exatrain can place each rank's block.")
    return True


def read_by_blocks(data_set, mesh):
    """`data_set` read by this rank's block of every sample (`SpatialBlocks`)."""
    from ..parallel.spatial import SpatialBlocks, block_region
    return SpatialBlocks(data_set, block_region(tuple(data_set.sample_shape[1:]), mesh))


def as_task(result, where: str) -> Task:
    if isinstance(result, Task):
        return result
    if isinstance(result, dict):
        known = {f.name for f in dataclasses.fields(Task)}
        unknown = set(result) - known
        if unknown:
            raise ConfigError(f"{where} returned unknown key(s) {sorted(unknown)}; a Task has "
                              f"{', '.join(sorted(known))}")
        return Task(**result)
    raise TypeError(f"{where} must return an exatrain.Task or a dict of its fields, got "
                    f"{type(result).__name__}")


# ---------------------------------------------------------------------------- the entry point
def split_spec(spec: str) -> tuple[str, str]:
    target, sep, function = spec.rpartition(":")
    if not sep or "/" in function or function.endswith(".py"):   # "file.py" alone, or a path
        target, function = spec, "build"
    return target, function


def _load_module(target: str, spec: str):
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ConfigError(f"run.workload={spec!r}: no such file {path}.")
        name = f"exatrain_user_{path.stem}_{abs(hash(str(path))) % 10 ** 8}"
        if name not in sys.modules:  # once per process: its classes stay the same objects
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"run.workload={spec!r}: cannot import module {target!r} ({exc}); "
                          "put its folder on PYTHONPATH, or give a file path such as "
                          "'path/to/model.py:build'.") from None


def _options_class(spec: str, section: str, fields: list) -> type:
    """A dataclass for one config section; it pickles by (spec, section, values), so it crosses
    into spawned ranks although it is made at run time."""
    cls = dataclasses.make_dataclass(f"{section.title()}Options", fields)
    cls.__reduce__ = lambda self: (_rebuild_options, (spec, section, dataclasses.asdict(self)))
    return cls


def _rebuild_options(spec: str, section: str, values: dict):
    workload = load_user_workload(spec)
    return getattr(workload, "ModelOptions" if section == "model" else "DataOptions")(**values)


def _dataclass_of(parameter: inspect.Parameter):
    if dataclasses.is_dataclass(parameter.annotation) and isinstance(parameter.annotation, type):
        return parameter.annotation
    if dataclasses.is_dataclass(parameter.default) and not isinstance(parameter.default, type):
        return type(parameter.default)
    return None


def _field_of(cls_field: dataclasses.Field):
    extra = {}
    if cls_field.default is not dataclasses.MISSING:
        extra["default"] = cls_field.default
    elif cls_field.default_factory is not dataclasses.MISSING:
        extra["default_factory"] = cls_field.default_factory
    return (cls_field.name, cls_field.type, field(**extra))


class UserWorkload:
    """Duck-types a built-in workload module: ModelOptions, DataOptions, prepare, build."""

    def __init__(self, spec: str, function: Callable):
        self.spec, self.function = spec, function
        self.where = f"run.workload={spec!r}"
        self.signature = inspect.signature(function)
        self.section_classes: dict[str, type] = {}
        scalar_fields = []
        for name, p in self.signature.parameters.items():
            if name == "mesh":
                continue
            cls = _dataclass_of(p)
            if name in ("model", "data") and cls is not None:
                self.section_classes[name] = cls
            elif p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            elif p.default is inspect.Parameter.empty:
                raise ConfigError(f"{self.where}: parameter {name!r} of {function.__name__} has no "
                                  "default; give it one (it is a [model] key), or annotate "
                                  "`model`/`data` with an options dataclass.")
            else:
                kind = p.annotation if p.annotation in (int, float, str, bool) else \
                    type(p.default) if type(p.default) in (int, float, str, bool) else Any
                scalar_fields.append((name, kind, field(default=p.default)))
        if "model" in self.section_classes and scalar_fields:
            raise ConfigError(f"{self.where}: {function.__name__} takes both `model` options and "
                              f"keyword options {[f[0] for f in scalar_fields]}; choose one.")
        model_fields = [_field_of(f) for f in dataclasses.fields(self.section_classes["model"])] \
            if "model" in self.section_classes else scalar_fields
        data_fields = [_field_of(f) for f in dataclasses.fields(self.section_classes["data"])] \
            if "data" in self.section_classes else []
        self.ModelOptions = _options_class(spec, "model", model_fields)
        self.DataOptions = _options_class(spec, "data", data_fields)

    def prepare(self, config, progress=None) -> None:
        """Nothing to generate: the user's data exist already."""

    def build(self, config, mesh) -> Workload:
        kwargs = {}
        params = self.signature.parameters
        for section in ("model", "data"):
            values = dataclasses.asdict(getattr(config, section))
            if section in self.section_classes:
                kwargs[section] = self.section_classes[section](**values)
            else:
                kwargs.update(values)
        if "mesh" in params:
            kwargs["mesh"] = mesh
        task = as_task(self.function(**kwargs), f"{self.function.__name__} ({self.spec})")
        return workload_from_task(task, mesh)


_LOADED: dict[str, UserWorkload] = {}


def is_user_spec(name: str) -> bool:
    return ":" in name or name.endswith(".py")


def load_user_workload(spec: str) -> UserWorkload:
    if spec not in _LOADED:
        target, function_name = split_spec(spec)
        module = _load_module(target, spec)
        function = getattr(module, function_name, None)
        if not callable(function):
            import difflib
            names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__]
            close = difflib.get_close_matches(function_name, names, n=1)
            raise ConfigError(f"run.workload={spec!r}: {target} has no function {function_name!r}."
                             + (f" Did you mean {close[0]!r}?" if close else
                                f" Functions there: {', '.join(sorted(names)) or 'none'}."))
        _LOADED[spec] = UserWorkload(spec, function)
    return _LOADED[spec]
