"""Check once, before the first step, that a user's model laid out over `space` computes what
the plain model computes on one process (`check_equals_plain`).

The spatial layers (convert.py) make the modules they replace equal to one process, and the guard
(guard.py) refuses the mixing functions a user's forward calls on a block. What neither can see is
forward code that takes the block's own extent or positions for the sample's: coordinates made
from `x.shape` (`torch.linspace(-1, 1, x.shape[-1])`, CoordConv), differences by slicing a
spatial dim (`x[:, :, 1:] - x[:, :, :-1]`), strided or fixed-position slices. On a block these
compute something else, and the model would train differently from one process without a word.

So the first sample goes through both models: the laid-out one on every rank (its first forward,
which the guard watches), the plain one on rank 0; in evaluation mode, without gradients, leaving
no trace in either (trial.leaves_no_trace), compiled code running eagerly. Where the outputs
differ by more than rounding, every rank raises a SpatialSplitError naming the first value that
differs: each module's input and output were summarised in call order (size, sum, sum of absolute
values), a block's summaries adding up over `space` to the whole tensor's, so the first summary
that differs names the forward that computed it.

Communication: the spatial forward's own (halos, the output's gather); one all-gather of the
summaries over `space` (a few dozen bytes per module call, tag "control") and one broadcast of
the verdict from rank 0 over the job. Cost: a forward of one sample on each model.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ...comm import all_gather_object, broadcast_object
from ...errors import SpatialSplitError
from ...mesh import Mesh
from ..nested import tensors_of
from ..trial import evaluating, leaves_no_trace
from ..zero import clean_fqn

# a summary: (module name, "input" | "output", call number) -> (numel, shape, sum, |sum|, split)
Key = tuple[str, str, int]


def _summary(t: torch.Tensor, split: bool) -> tuple:
    v = torch.view_as_real(t) if t.is_complex() else t
    v = v.detach().double()
    return t.numel(), tuple(t.shape), float(v.sum()), float(v.abs().sum()), split


class _Trace:
    """Summaries of the first input tensor and the output tensors of every module under `root`,
    in call order, named as in the user's model (checkpoint wrappers left out). With `runtime`
    (the laid-out model's): whether each tensor is this rank's spatial block."""

    def __init__(self, root: nn.Module, runtime=None):
        self.runtime, self.entries, self.calls = runtime, {}, Counter()
        self.types: dict[str, str] = {}
        self.handles = []
        for name, module in root.named_modules():
            name = clean_fqn(name)
            self.types[name] = type(module).__name__
            self.handles += [module.register_forward_pre_hook(self._enter(name)),
                             module.register_forward_hook(self._leave(name))]

    def _split(self, t: torch.Tensor) -> bool:
        rt = self.runtime
        return rt is not None and not rt.gathered and t.dim() - 2 == rt.input_dims

    def _note(self, name: str, kind: str, tensors: list) -> None:
        call = self.calls[(name, kind)]
        self.calls[(name, kind)] += 1
        for i, t in enumerate(tensors):
            self.entries[(name, f"{kind} {i}" if i else kind, call)] = _summary(t, self._split(t))

    def _enter(self, name: str):
        def hook(_module, args):
            self._note(name, "input", tensors_of(args)[:1])
        return hook

    def _leave(self, name: str):
        def hook(_module, _args, out):
            self._note(name, "output", tensors_of(out))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _traced_forward(model: nn.Module, x: torch.Tensor, root: nn.Module,
                    runtime=None) -> tuple[list, dict, dict]:
    """(output tensors, summaries of the modules under `root`, their types) of one forward of
    `model` on `x`."""
    trace = _Trace(root, runtime)
    try:
        with leaves_no_trace([model]), evaluating(model), torch.no_grad(), \
                torch.compiler.set_stance("force_eager"):
            out = model(x)
    finally:
        trace.remove()
    return tensors_of(out), trace.entries, trace.types


def _whole(per_rank: list[dict]) -> dict:
    """One rank's summaries as the whole tensors': a block's added over the spatial ranks."""
    first = per_rank[0]
    if any(r.keys() != first.keys() for r in per_rank):
        return {}   # the ranks' forwards took different paths: nothing to line up
    whole = {}
    for key, (numel, shape, total, size, split) in first.items():
        if split:
            parts = [r[key] for r in per_rank]
            whole[key] = (sum(p[0] for p in parts), None, sum(p[2] for p in parts),
                          sum(p[3] for p in parts))
        else:
            whole[key] = (numel, shape, total, size)
    return whole


def _tolerance(dtype: torch.dtype) -> float:
    return max(1e-4, 16 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _first_difference(serial: dict, spatial: dict, tol: float) -> Key | None:
    for key, (numel, shape, total, size) in serial.items():
        if key not in spatial:
            continue   # a module of one model only (inside exatrain's spatial layers)
        s_numel, s_shape, s_total, s_size = spatial[key]
        if s_numel != numel or (s_shape is not None and s_shape != shape) or \
                abs(s_total - total) > tol * size + 1e-12 or abs(s_size - size) > tol * size + 1e-12:
            return key
    return None


def _where(key: Key | None, types: dict) -> str:
    if key is None:
        return ""
    name, kind, call = key
    shown = f"'{name}' ({types.get(name, '?')})" if name else f"the model ({types.get('', '?')})"
    nth = f" (its call {call + 1})" if call else ""
    if kind.startswith("input"):
        parent = name.rpartition(".")[0]
        computed = f"{types.get(parent, '?')}.forward" + (f" ('{parent}')" if parent else "")
        return (f" The first value that differs is the input of {shown}{nth}, computed in "
                f"{computed}, while every module that ran before it agreed.")
    return (f" The first value that differs is the output of {shown}{nth}, computed in "
            f"{types.get(name, '?')}.forward from an input that agreed.")


def _verdict(plain_out: list, spatial_out: list, serial: dict, spatial: dict, types: dict,
             x: torch.Tensor, mesh: Mesh) -> str | None:
    """The message when the laid-out model's output differs from the plain one's, else None."""
    tol = _tolerance(plain_out[0].dtype if plain_out else torch.float32)
    shapes = [tuple(t.shape) for t in plain_out], [tuple(t.shape) for t in spatial_out]
    if shapes[0] != shapes[1]:
        detail = f"its output has shapes {shapes[1]} where one process's has {shapes[0]}"
    else:
        worst, scale = 0.0, 0.0
        for a, b in zip(plain_out, spatial_out):
            a, b = a.detach().double().cpu(), b.detach().double().cpu()
            if a.numel():
                worst = max(worst, float((a - b).abs().max()))
                scale = max(scale, float(a.abs().max()))
        if worst <= tol * scale + 1e-12:
            return None
        detail = (f"the largest difference is {worst:.3g}, where one process's output reaches "
                  f"{scale:.3g}")
    parts = tuple(mesh.plan.space)
    k = x.dim() - 2
    whole = tuple(x.shape[2:])
    block = tuple(n // p for n, p in zip(whole, parts[3 - k:]))
    return (f"under {mesh.plan} the model's output on the training set's first sample differs "
            f"from the same model's on one process ({detail}): it would train differently."
            f"{_where(_first_difference(serial, spatial, tol), types)} Under space={parts} each "
            f"rank's forward sees a block {list(block)} of the sample's {list(whole)}: code in "
            f"forward that takes the block's extent or positions for the sample's computes "
            f"something else there (coordinates from x.shape, torch.linspace / arange / meshgrid "
            f"over it; differences or strides by slicing a spatial dim, x[:, :, 1:] - "
            f"x[:, :, :-1], x[..., ::2]). Compute such inputs in the data set (coordinate "
            f"channels), write a difference as an nn.Conv with fixed weights and padding "
            f"(exatrain gives it halos), or train with space=(1, 1, 1). parallel.space_check = "
            f"false skips this check.")


def check_equals_plain(plain: nn.Module, laid_out: nn.Module, x: torch.Tensor, mesh: Mesh) -> None:
    """Collective (every rank of `mesh`): raise SpatialSplitError on every rank when `laid_out`
    (`parallelize(plain, ..., whole_samples=True)` under space) computes a different output
    from `plain` on the whole input `x` (module doc). `plain` must hold the weights `laid_out`
    started from; only rank 0 runs it."""
    # the converted model inside the wrappers (data-parallel, compile), named as the user's
    root = next((m for m in laid_out.modules() if hasattr(m, "spatial_runtime")), laid_out)
    device = next((t.device for t in laid_out.parameters()), mesh.device)
    spatial_out, spatial, _ = _traced_forward(laid_out, x.to(device), root,
                                              getattr(root, "spatial_runtime", None))
    per_rank = all_gather_object(spatial, mesh.axis("space"))
    verdict = None
    if mesh.rank == 0:
        where = next((t.device for t in plain.parameters()), torch.device("cpu"))
        try:
            plain_out, serial, types = _traced_forward(plain, x.to(where), plain)
        except Exception:   # noqa: BLE001 - a forward that fails alone: nothing to compare with
            plain_out = None
        if plain_out is not None:
            serial = {key: value[:4] for key, value in serial.items()}
            verdict = _verdict(plain_out, spatial_out, serial, _whole(per_rank), types, x, mesh)
    verdict = broadcast_object(verdict, mesh.world)
    if verdict:
        raise SpatialSplitError(verdict)
