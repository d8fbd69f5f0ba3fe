"""Check once, before the first step, that a user's model laid out over `space` or `tensor`
computes what the plain model computes on one process (`check_equals_plain`).

The layers these strategies swap in are equal to one process, and what a user's forward does
around them is watched where it can be (spatial/guard.py refuses the mixing functions a forward
calls on a block; reads.py keeps whole the weights a forward reads outside their layer). What
neither can see is forward code that takes the part a rank holds for the whole: under space,
coordinates made from `x.shape` (`torch.linspace(-1, 1, x.shape[-1])`, CoordConv), differences
by slicing a spatial dim (`x[:, :, 1:] - x[:, :, :-1]`), strided or fixed-position slices; under
tensor, a size or a weight read from a split layer. These compute something else, and the model
would train differently from one process without a word.

So the first sample goes through both models: the laid-out one on every rank (under space its
first forward, which the guard watches), the plain one on rank 0; in evaluation mode, without
gradients, leaving no trace in either (trial.leaves_no_trace), compiled code running eagerly.
Where the outputs differ by more than rounding, every rank raises a SpatialSplitError (under
space) or TensorSplitError naming the first value that differs: each module's input and output
were summarised in call order (size, sum, sum of absolute values), a spatial block's summaries
adding up over `space` to the whole tensor's; a tensor a rank holds a slice of (its shape is not
the plain one's) is not compared. The first summary that differs names the forward that computed
it.

Communication: the laid-out forward's own (halos, the output's gather, tensor parallelism's
all-reduces); one all-gather of the summaries over `space` (a few dozen bytes per module call,
tag "control") and one broadcast of the verdict from rank 0 over the job. Cost: a forward of one
sample on each model.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

from ..comm import all_gather_object, broadcast_object
from ..errors import SpatialSplitError, TensorSplitError
from ..mesh import Mesh
from .data import unwrap
from .nested import call_on, map_tensors, tensors_of
from .trial import probing
from .zero import clean_fqn

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
        # a wrapper (activation checkpointing, compile) and the module it wraps share a name:
        # the module, named after the wrapper, comes later and is the one watched
        named = {clean_fqn(name): module for name, module in root.named_modules()}
        for name, module in named.items():
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
        with probing(model), torch.no_grad():
            out = call_on(model, x)
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


def _output_difference(plain_out: list, laid_out_out: list) -> str | None:
    """How the outputs differ beyond rounding (None: they agree). Each output tensor against its
    own scale and its dtype's rounding (complex as its real and imaginary parts; integer and
    bool outputs exactly); non-finite values must sit where one process's are."""
    shapes = [tuple(t.shape) for t in plain_out], [tuple(t.shape) for t in laid_out_out]
    if shapes[0] != shapes[1]:
        return f"its output has shapes {shapes[1]} where one process's has {shapes[0]}"
    for i, (a, b) in enumerate(zip(plain_out, laid_out_out)):
        which = f"output {i}: " if len(plain_out) > 1 else ""
        if a.dtype != b.dtype:
            return f"{which}its dtype is {b.dtype} where one process's is {a.dtype}"
        tol = _tolerance(a.dtype if not a.is_complex() else a.real.dtype)
        a, b = (torch.view_as_real(t) if t.is_complex() else t for t in (a, b))
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if not a.numel():
            continue
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or \
                not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return f"{which}its NaN or infinite values are not where one process's are"
        worst = float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0
        scale = float(a[finite].abs().max()) if finite.any() else 0.0
        if worst > tol * scale + 1e-12:
            return (f"{which}the largest difference is {worst:.3g}, where one process's output "
                    f"reaches {scale:.3g}")
    return None


def _first_difference(serial: dict, laid_out: dict, tol: float) -> tuple:
    """(the first summary that differs, the last one compared that agreed, whether summaries were
    left uncompared between them), in the plain model's call order."""
    agreed, skipped = None, False
    for key, (numel, shape, total, size) in serial.items():
        if key not in laid_out:
            continue   # a module of one model only (inside exatrain's layers)
        s_numel, s_shape, s_total, s_size = laid_out[key]
        if s_shape is not None and s_shape != shape:
            skipped = True   # this rank's slice of a tensor-split layer's tensor: not comparable
            continue
        if s_numel != numel or abs(s_total - total) > tol * size + 1e-12 or \
                abs(s_size - size) > tol * size + 1e-12:
            return key, agreed, skipped
        agreed, skipped = key, False
    return None, agreed, skipped


def _where(found: tuple, types: dict) -> str:
    key, agreed, skipped = found
    if key is None:
        return ""

    def shown(k: Key) -> str:
        name, kind, call = k
        module = f"'{name}' ({types.get(name, '?')})" if name else \
            f"the model ({types.get('', '?')})"
        return f"the {kind} of {module}" + (f" (its call {call + 1})" if call else "")

    name, kind, _ = key
    parent = name.rpartition(".")[0]
    caller = f"{types.get(parent, '?')}.forward" + (f" ('{parent}')" if parent else "")
    if skipped:
        last = f"; the last that agreed is {shown(agreed)}" if agreed else ""
        return (f" The first value that differs is {shown(key)}{last}. Between them each rank "
                f"holds only its slice of some tensors (not compared): the difference arises "
                f"there, in the split layers or in the code between them ({caller}).")
    if kind.startswith("input"):
        return (f" The first value that differs is {shown(key)}, computed in {caller}, while "
                f"every module that ran before it agreed.")
    return (f" The first value that differs is {shown(key)}, computed in "
            f"{types.get(name, '?')}.forward from an input that agreed.")


def _advice(x: torch.Tensor, mesh: Mesh, split_layers: list[str]) -> str:
    """What each rank's forward sees of the sample or the model, and the fixes."""
    plan = mesh.plan
    if plan.space_degree == 1:
        shown = ", ".join(f"'{n}'" for n in split_layers[:4]) + (", ..." if len(split_layers) > 4
                                                                 else "")
        return (f" Under {plan} the layers it splits ({shown}) each hold a slice of their "
                f"weights, and between a column → row pair of Linears, of the features: code "
                f"between two such layers that works across the features (a softmax or a sum "
                f"over them, a flip, a reshape that moves them) computes on a slice, and code "
                f"that reads a split layer's weight or sizes sees the slice. Set "
                f"parallel.tensor_pairs = false (each Linear split on its own, its output "
                f"gathered), read sizes from the tensors the layers return, or train this model "
                f"with Plan(data=...) or Plan(shard=...), which do not split its layers. "
                f"parallel.check_plain = false skips this check.")
    parts = tuple(plan.space)
    x = max(tensors_of(x), key=lambda t: t.dim())   # the input the blocks are cut from
    k = x.dim() - 2
    whole = tuple(x.shape[2:])
    block = tuple(n // p for n, p in zip(whole, parts[3 - k:]))
    return (f" Under space={parts} each rank's forward sees a block {list(block)} of the "
            f"sample's {list(whole)}: code in forward that takes the block's extent or positions "
            f"for the sample's computes something else there (coordinates from x.shape, "
            f"torch.linspace / arange / meshgrid over it; differences or strides by slicing a "
            f"spatial dim, x[:, :, 1:] - x[:, :, :-1], x[..., ::2]). Compute such inputs in the "
            f"data set (coordinate channels), write a difference as an nn.Conv with fixed weights "
            f"and padding (exatrain gives it halos), or train with space=(1, 1, 1). "
            f"parallel.check_plain = false skips this check.")


def _verdict(plain_out: list, laid_out_out: list, serial: dict, laid_out: dict, types: dict,
             x: torch.Tensor, mesh: Mesh, split_layers: list[str]) -> str | None:
    """The message when the laid-out model's output differs from the plain one's, else None."""
    detail = _output_difference(plain_out, laid_out_out)
    if detail is None:
        return None
    floating = [t.dtype for t in plain_out if t.is_floating_point() or t.is_complex()]
    tol = max(map(_tolerance, (d if d.is_floating_point else torch.float32 for d in floating)),
              default=_tolerance(torch.float32))
    return (f"under {mesh.plan} the model's output on the training set's first sample differs "
            f"from the same model's on one process ({detail}): it would train differently."
            f"{_where(_first_difference(serial, laid_out, tol), types)}"
            f"{_advice(x, mesh, split_layers)}")


def _rank_0_verdict(plain: nn.Module, x, laid_out_out: list, per_rank: list, root: nn.Module,
                    mesh: Mesh) -> str | None:
    where = next((t.device for t in plain.parameters()), torch.device("cpu"))
    plain_out, serial, types = _traced_forward(plain, map_tensors(x, lambda t: t.to(where)),
                                               plain)
    serial = {key: value[:4] for key, value in serial.items()}
    split = dict.fromkeys(clean_fqn(name).rpartition(".")[0]   # the split layers
                          for name, p in root.named_parameters()
                          if getattr(p, "exatrain_layout", ()))
    return _verdict(plain_out, laid_out_out, serial, _whole(per_rank), types, x, mesh,
                    list(split))


def laid_out_root(laid_out: nn.Module) -> tuple[nn.Module, object]:
    """(the converted model inside the wrappers (data-parallel, compile), named as the user's;
    its SpatialRuntime or None)."""
    root = next((m for m in laid_out.modules() if hasattr(m, "spatial_runtime")),
                unwrap(laid_out))
    return root, getattr(root, "spatial_runtime", None)


@contextlib.contextmanager
def guard_kept(runtime):
    """Around a checking forward of a spatial model: the guard (spatial/guard.py) still watches
    the first training forward after it (code under `if self.training`)."""
    try:
        yield
    finally:
        if runtime is not None:
            runtime.watched = False


def check_equals_plain(plain: nn.Module, laid_out: nn.Module, x, mesh: Mesh) -> None:
    """Collective (every rank of `mesh`): raise on every rank when `laid_out` (`parallelize(plain,
    ..., whole_samples=True)` under space and/or tensor, not pipe) computes a different output
    from `plain` on the whole input `x`, the same on every rank (one tensor, or several:
    nested.call_on) (module doc). `plain` must hold the weights `laid_out` started from; only
    rank 0 runs it."""
    root, runtime = laid_out_root(laid_out)
    device = next((t.device for t in laid_out.parameters()), mesh.device)
    with guard_kept(runtime):
        laid_out_out, summaries, _ = _traced_forward(
            laid_out, map_tensors(x, lambda t: t.to(device)), root, runtime)
    per_rank = all_gather_object(summaries, mesh.axis("space"))
    verdict = None
    if mesh.rank == 0:
        try:
            verdict = _rank_0_verdict(plain, x, laid_out_out, per_rank, root, mesh)
        except Exception:   # noqa: BLE001 - the plain forward failed alone (training will say
            verdict = None  # why), or the comparison did: the other ranks must not wait on it
    verdict = broadcast_object(verdict, mesh.world)
    if verdict:
        raise (SpatialSplitError if mesh.plan.space_degree > 1 else TensorSplitError)(verdict)
