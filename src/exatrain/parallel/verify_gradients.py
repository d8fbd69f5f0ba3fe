"""Check once, before the first step, that a user's model laid out over `space` computes the
gradients the plain model computes (`check_gradients_equal`), after verify.py found its outputs
equal.

Equal outputs do not make equal gradients under space. Each spatial rank computes its block's
share of a parameter's gradient, and the gradient reduction sums the shares over `space`; a
layer that runs on the gathered tensor computes the whole gradient on every rank, scaled by 1/S
before that sum (spatial/runtime.note_mode). A layer put on the wrong side of that line is
counted S times, or 1/S times, and no forward shows it. So one backward runs through both
models on the first training sample: the loss a fixed random projection of the outputs (the same
on every rank); through the laid-out model inside its data-parallel wrapper (whose own state the
check leaves alone), its gradients then summed over `space` as the gradient reduction sums them;
through the plain model on rank 0. Evaluation mode, compiled code eager, no trace left (buffers,
random streams; every gradient set back to None). Rank 0 compares each parameter's gradient,
and every rank raises a SpatialSplitError naming the parameters whose gradients differ.

Under space alone, or with data: tensor's split parameters hold slices and shard's gradients
are shards, which no rank holds whole. Communication: one all-reduce over `space` of every
gradient, flat (4 bytes per float32 parameter, tag "control"), one broadcast of the verdict from
rank 0. Cost: a forward and a backward of one sample on each model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_reduce, broadcast_object
from ..errors import SpatialSplitError
from ..mesh import Mesh
from .data import unwrap
from .nested import call_on, map_tensors, tensors_of
from .trial import probing
from .verify import guard_kept, laid_out_root
from .zero import clean_fqn

RTOL = 1e-3   # float32 sums in another order move a gradient by ~1e-6; a miscount by 50 % or more


def _projection(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed random weights for each output (the same on every rank: whole outputs' shapes)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in outputs]


def _gradients(model: nn.Module, root: nn.Module, x) -> dict[str, torch.Tensor | None]:
    """{parameter name under `root`: its gradient (None: it got none)} after one backward of
    the projected outputs of `model` on `x`; the parameters' gradients are None again after."""
    params = {clean_fqn(n): p for n, p in root.named_parameters()}
    try:
        with probing(model):
            out = [t for t in tensors_of(call_on(model, x)) if t.is_floating_point()]
            if not out or not any(t.requires_grad for t in out):
                return {}
            loss = sum((t.double() * w.to(t.device)).sum() for t, w in zip(out, _projection(out)))
            loss.backward()
        return {n: None if p.grad is None else p.grad.detach().clone()
                for n, p in params.items()}
    finally:
        for p in model.parameters():
            p.grad = None


def _summed_over_space(grads: dict, root: nn.Module, mesh: Mesh) -> dict:
    """Each rank's shares of the gradients summed over `space`, as the gradient reduction sums
    them (a gradient no rank got stays None); every parameter takes part, so the ranks' buffers
    match whichever got a gradient."""
    if not grads:
        return grads
    shapes = {clean_fqn(n): p.shape for n, p in root.named_parameters()}
    names = sorted(grads)
    got = torch.tensor([float(grads[n] is not None) for n in names], dtype=torch.float64)
    device = mesh.device
    flat = torch.cat([got.to(device)] + [
        (grads[n].double().to(device) if grads[n] is not None else
         torch.zeros(shapes[n], dtype=torch.float64, device=device)).flatten() for n in names])
    all_reduce(flat, mesh.axis("space"), tag="control")
    out, at = {}, len(names)
    for i, n in enumerate(names):
        size = shapes[n].numel()
        out[n] = flat[at:at + size].view(shapes[n]) if flat[i] > 0 else None
        at += size
    return out


def _difference(plain: dict, laid_out: dict) -> list[tuple[str, float, float]]:
    """(name, |laid-out| / |plain|, relative difference) of each parameter whose gradient differs
    beyond RTOL of its own norm (with a floor at 1e-6 of the largest gradient's norm)."""
    norms = [float(g.double().norm()) for g in plain.values() if g is not None]
    floor = 1e-6 * max(norms, default=0.0)
    found = []
    for name, a in plain.items():
        b = laid_out.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            found.append((name, float("nan"), float("inf")))
            continue
        a, b = a.double().cpu(), b.double().cpu()
        ref, diff = float(a.norm()), float((a - b).norm())
        if diff > RTOL * ref + floor:
            found.append((name, float(b.norm()) / ref if ref else float("inf"),
                          diff / ref if ref else float("inf")))
    return found


def _message(found: list, mesh: Mesh) -> str:
    shown = "; ".join(
        f"'{name}' {'got none on one side' if ratio != ratio else f'{ratio:.3g}x one process'}"
        f"{'' if ratio != ratio else f' (relative difference {rel:.2g})'}"
        for name, ratio, rel in found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4
                                               else "")
    return (f"under {mesh.plan} the model's output on the training set's first sample equals "
            f"one process's, but its gradients do not: {shown}. Each spatial rank computes its "
            f"block's share of a gradient and exatrain sums the shares over space, while a layer "
            f"after the gather (nn.Flatten, a global pooling) computes the whole on every rank "
            f"and is counted once; a layer whose output feeds both, or that exatrain placed on "
            f"the wrong side, is counted wrongly, and training would differ from one process. "
            f"Train this model with space=(1, 1, 1) (its other axes are unaffected), and report "
            f"the model and these names. parallel.check_plain = false skips this check.")


def check_gradients_equal(plain: nn.Module, laid_out: nn.Module, x, mesh: Mesh) -> None:
    """Collective (every rank of `mesh`): raise on every rank when the gradients of `laid_out`
    (`parallelize(plain, ..., whole_samples=True)` under space, with data at most) on the whole
    input `x` (the same on every rank) differ from those of `plain` (module doc)."""
    root, runtime = laid_out_root(laid_out)
    device = next((t.device for t in laid_out.parameters()), mesh.device)
    with guard_kept(runtime):   # inside the data-parallel wrapper: its reducer is not touched
        grads = _gradients(unwrap(laid_out), root, map_tensors(x, lambda t: t.to(device)))
    grads = _summed_over_space(grads, root, mesh)
    verdict = None
    if mesh.rank == 0 and grads:
        try:
            where = next((t.device for t in plain.parameters()), torch.device("cpu"))
            reference = _gradients(plain, plain, map_tensors(x, lambda t: t.to(where)))
            found = _difference(reference, grads) if reference else []
            verdict = _message(found, mesh) if found else None
        except Exception:   # noqa: BLE001 - the plain backward failed alone (out of memory on
            verdict = None  # one process, say): nothing to compare with; the others must not wait
    verdict = broadcast_object(verdict, mesh.world)
    if verdict:
        raise SpatialSplitError(verdict)
