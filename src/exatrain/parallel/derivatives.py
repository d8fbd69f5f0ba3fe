"""Whether a model's forward differentiates: forces as -dE/dx of a learned energy, a
physics-informed residual from du/dx, a gradient penalty (`torch.autograd.grad` or
`torch.autograd.backward` in `forward`, or `torch.func`'s transforms, which call them).

Trained on such outputs, the loss's backward runs through the first derivative's own graph
(`create_graph=True`): the step needs second derivatives. Data parallelism (PyTorch's DDP),
ZeRO-1/2 and 1D tensor parallelism give them as one process does (the collectives of 1D
tensor parallelism have differentiable backwards: comm/autograd.py). What cannot, refused by
`derivative_refusal` before the first step with what to use instead:
- FSDP2 (ZeRO-3) frees a block's gathered weights when its backward ends, which here is the
  first derivative's backward, inside the forward, while the loss's backward still needs them;
- 3D tensor parallelism, `space`'s halo convolutions, global BatchNorm's statistics and the
  branches' batch exchange compute their backward by hand, once; 1D tensor under `torch.func`
  (its Functions are not functorch's);
- `pipe`: the derivative runs back through every stage within one stage's forward;
- torch.compile (AOTAutograd has no double backward) and selective activation checkpointing
  (a region's backward runs once);
- K-FAC, whose curvature would take the derivative's backward for the loss's.

`find_derivatives` runs the forward twice on one sample, leaving no trace in the model
(parallel/trial.py), with a TorchFunctionMode counting those calls: once as a training step runs
it (training mode, gradients on: a derivative taken only in training counts), once as
evaluation does (evaluation mode, under `torch.no_grad()`). Where a derivative fails in the
second, the forward needs `torch.enable_grad()` around it: exatrain evaluates and predicts
without gradients, as a PyTorch evaluation loop does. No communication;
`train.user_checks.check_derivatives` takes rank 0's finding on every rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .nested import call_on
from .trial import leaves_no_trace, probing

DIFFERENTIATE = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class DerivativeCalls(TorchFunctionMode):
    """Within: the calls that differentiate are counted (`calls`; those made by `torch.func`'s
    transforms in `functorch`), and the exception one of them raised kept (`failed`); the
    planner's trace under fake tensors counts them too."""

    def __init__(self):
        super().__init__()
        self.calls, self.functorch, self.failed = 0, 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in DIFFERENTIATE:
            return func(*args, **(kwargs or {}))
        self.calls += 1
        self.functorch += _called_by_functorch()
        try:
            return func(*args, **(kwargs or {}))
        except Exception as exc:
            self.failed = exc
            raise


def _called_by_functorch() -> bool:
    """Whether the first caller outside torch.autograd / torch.overrides is torch.func's."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("torch.autograd", "torch.overrides", "torch._tensor")):
            return module.startswith("torch._functorch")
        frame = frame.f_back
    return False


@dataclass
class Found:
    """What `find_derivatives` found: calls that differentiate (in training or evaluation),
    those through torch.func, and the exception one raised without gradients (or None)."""
    calls: int = 0
    functorch: int = 0
    failed_without_grad: BaseException | None = None


def find_derivatives(model: nn.Module, inputs) -> Found:
    """The module doc's two forwards of `model` on `inputs`. A forward that fails otherwise
    (not in a derivative) finds what it found before failing: training says why."""
    found = Found()
    training = DerivativeCalls()
    modes = {id(m): m.training for m in model.modules()}
    grads = [(p, p.grad) for p in model.parameters()]   # a backward in forward accumulates
    try:
        with leaves_no_trace([model]), torch.compiler.set_stance("force_eager"), \
                torch.enable_grad(), training:
            model.train()
            call_on(model, inputs)
    except Exception:   # noqa: BLE001 - the training forward reports it, where it belongs
        pass
    finally:
        for m in model.modules():
            m.training = modes[id(m)]
        for p, grad in grads:
            p.grad = grad
    evaluation = DerivativeCalls()
    try:
        with probing(model), torch.no_grad(), evaluation:
            call_on(model, inputs)
    except Exception:   # noqa: BLE001 - only a derivative's own failure is reported here
        if evaluation.failed is not None:
            found.failed_without_grad = evaluation.failed
    found.calls = max(training.calls, evaluation.calls)
    found.functorch = max(training.functorch, evaluation.functorch)
    return found


def no_grad_message(model: nn.Module, exc: BaseException) -> str:
    """Why a forward that differentiates failed without gradients, and the fix."""
    name = type(model).__name__
    return (f"{name}.forward differentiates (torch.autograd.grad), which failed where gradients "
            f"are off ({type(exc).__name__}: {exc}). exatrain evaluates and predicts under "
            f"torch.no_grad(), as a PyTorch evaluation loop does; put the derivative in "
            f"`with torch.enable_grad():` (x.requires_grad_(True) inside it), with "
            f"create_graph=self.training, so evaluation computes it and training can "
            f"differentiate it again.")


def derivative_refusal(model_name: str, plan, *, zero_stage: int = 3, functorch: bool = False,
                       batchnorm: bool = False, options=None, optimizer: str = "",
                       compiled: bool = False, tensor_ok: bool = True) -> str | None:
    """Why a model whose forward differentiates cannot train under `plan` with these settings
    (with the fix), or None. `batchnorm`: the model has BatchNorm layers; `options`: the
    [parallel] section (None: its defaults); `compiled`: the user compiled the model;
    `tensor_ok`: the model can be split over `tensor` at all (DimeNet++ cannot)."""
    why = []
    if plan.pipe > 1:
        why.append(f"pipe={plan.pipe}: the derivative runs back through every stage inside one "
                   f"stage's forward")
    if plan.space_degree > 1:
        why.append(f"space={tuple(plan.space)}: its halo exchanges and block reductions compute "
                   f"their backward once, by hand")
    if plan.tensor_degree > 1 and plan.tensor_3d:
        why.append(f"tensor={tuple(plan.tensor)} (3D): its matrix multiply computes its backward "
                   f"once, by hand")
    elif plan.tensor_degree > 1 and functorch:
        why.append(f"tensor={plan.tensor} under torch.func: the split layers' collectives are "
                   f"not functorch Functions; take the derivative with torch.autograd.grad")
    if plan.shard > 1 and zero_stage == 3:
        why.append(f"shard={plan.shard} with parallel.zero_stage=3 (FSDP2): a block's gathered "
                   f"weights are freed when the derivative's backward ends, inside the forward, "
                   f"while the loss's backward still needs them; parallel.zero_stage=2 (or 1) "
                   f"trains it")
    if options is not None:
        if batchnorm and plan.data * plan.shard > 1 and options.batchnorm == "global":
            why.append("parallel.batchnorm='global': its statistics over the replicas have a "
                       "backward written once; 'replica' (each replica's own, as DDP without "
                       "SyncBatchNorm) trains it")
        if options.branches != "none":
            why.append(f"parallel.branches={options.branches!r}: the branches' batch exchange "
                       f"has a backward written once; 'none' trains it")
        if options.activation_checkpointing == "selective":
            why.append("parallel.activation_checkpointing='selective': a region's backward runs "
                       "once; 'full' or 'none' trains it")
        if options.compile:
            why.append("parallel.compile=true: torch.compile's AOTAutograd has no double "
                       "backward; parallel.compile=false trains it")
        if options.precision == "fp8":
            why.append("parallel.precision='fp8': torchao's float8 matmuls have a backward that "
                       "casts to float8, not differentiable again; 'bf16' trains it")
        if options.cuda_graphs and options.cuda_graphs_scope == "step":
            why.append("parallel.cuda_graphs_scope='step': recording a step whose forward takes "
                       "its own derivative has never been run; parallel.cuda_graphs=false "
                       "trains it")
    if compiled:
        why.append("the model is compiled (torch.compile): AOTAutograd has no double backward; "
                   "pass the module uncompiled")
    if optimizer == "kfac":
        why.append("optim.name='kfac': its curvature would take the derivative's backward for "
                   "the loss's; optim.name='adamw' (or 'sgd') trains it")
    if not why:
        return None
    return (f"{model_name}.forward differentiates its outputs (torch.autograd.grad: forces, a "
            f"physics residual), so training needs second derivatives, which {plan} with these "
            f"settings cannot give: {'; '.join(why)}. "
            + ("Data parallelism, shard with ZeRO-1/2 and 1D tensor parallelism (plan.tensor=N)"
               if tensor_ok else "Data parallelism and shard with ZeRO-1/2")
            + " give them as one process does.")
