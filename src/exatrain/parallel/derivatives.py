"""Whether a model's forward differentiates: forces as -dE/dx of a learned energy, a
physics-informed residual from du/dx, a gradient penalty (`torch.autograd.grad` in `forward`,
or `torch.func`'s transforms, which call it).

Trained on such outputs, the loss's backward runs through the first derivative's own graph
(`create_graph=True`): the step needs second derivatives. Data parallelism (PyTorch's DDP),
ZeRO-1/2 and 1D tensor parallelism give them as one process does (the collectives of 1D
tensor parallelism have differentiable backwards: comm/autograd.py). The other layouts cannot:
FSDP2 (ZeRO-3) frees a block's gathered weights when its backward ends, which here is the first
derivative's backward, inside the forward, while the loss's backward still needs them; 3D tensor
parallelism and `space`'s halo convolutions compute their backward by hand, once; under `pipe`
the derivative runs back through every stage within one stage's forward. `derivative_refusal`
says which and what to use instead, before the first step.

`differentiates` runs one forward as evaluation runs it (evaluation mode, under
`torch.no_grad()`), watching for `torch.autograd.grad` (a TorchFunctionMode) and leaving no
trace in the model (parallel/trial.py). A forward that calls it and fails there needs
`torch.enable_grad()` around its derivative: exatrain evaluates and predicts without gradients,
as a PyTorch evaluation loop does. No communication; `train.job.check_derivatives` takes rank
0's finding on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .nested import call_on
from .trial import probing


class DerivativeCalls(TorchFunctionMode):
    """Within: the calls of `torch.autograd.grad` are counted (`calls`); the planner's trace
    under fake tensors counts them too."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.autograd.grad:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def differentiates(model: nn.Module, inputs) -> tuple[bool, BaseException | None]:
    """(whether `model`'s forward on `inputs` calls `torch.autograd.grad`, the exception the
    forward raised under `torch.no_grad()` after calling it, or None)."""
    watch = DerivativeCalls()
    try:
        with probing(model), torch.no_grad(), watch:
            call_on(model, inputs)
    except Exception as exc:   # noqa: BLE001 - any other failure: training says why
        return watch.calls > 0, exc if watch.calls else None
    return watch.calls > 0, None


def no_grad_message(model: nn.Module, exc: BaseException) -> str:
    """Why a forward that differentiates failed without gradients, and the fix."""
    name = type(model).__name__
    return (f"{name}.forward calls torch.autograd.grad, which failed where gradients are off "
            f"({type(exc).__name__}: {exc}). exatrain evaluates and predicts under "
            f"torch.no_grad(), as a PyTorch evaluation loop does; put the derivative in "
            f"`with torch.enable_grad():` (x.requires_grad_(True) inside it), with "
            f"create_graph=self.training, so evaluation computes it and training can "
            f"differentiate it again.")


def derivative_refusal(model_name: str, plan, zero_stage: int) -> str | None:
    """Why `plan` cannot train a model whose forward differentiates (with the fix), or None."""
    why = []
    if plan.pipe > 1:
        why.append(f"pipe={plan.pipe}: the derivative runs back through every stage inside one "
                   f"stage's forward")
    if plan.space_degree > 1:
        why.append(f"space={tuple(plan.space)}: the halo convolutions compute their backward once, "
                   f"by hand")
    if plan.tensor_degree > 1 and plan.tensor_3d:
        why.append(f"tensor={tuple(plan.tensor)} (3D): its matrix multiply computes its backward "
                   f"once, by hand")
    if plan.shard > 1 and zero_stage == 3:
        why.append(f"shard={plan.shard} with parallel.zero_stage=3 (FSDP2): a block's gathered "
                   f"weights are freed when the derivative's backward ends, inside the forward, "
                   f"while the loss's backward still needs them; parallel.zero_stage=2 (or 1) "
                   f"trains it")
    if not why:
        return None
    return (f"{model_name}.forward calls torch.autograd.grad (a derivative of its outputs: forces, "
            f"a physics residual), so training needs second derivatives, which {plan} cannot "
            f"give: {'; '.join(why)}. Data, shard with ZeRO-1/2 and 1D tensor parallelism "
            f"(plan.tensor=N) train such a model as one process does.")
