"""The optimizer factory: one place that builds the optimizer of `[optim]` for a model.

`build_optimizer_for(model, build)` hands `build` the tensors the model's optimizer must step
(plain, DDP and FSDP2 models: the trainable parameters; ZeRO-1/2: the rank's shards, with the
post-step all-gather wired); `build_optimizer(params, options, lr)` is the torch optimizer that
`optim.name` names (K-FAC: its first-order base, which `optim.kfac.KFAC` wraps), on the kernel
`optimizer_kernel` picks. The fused kernels need two things around them: gradients laid out like
their parameters (`match_grad_layouts`), and knowing whether they skip a non-finite step on the
device (`supports_found_inf`).

Callers: the Trainer, the planner's dry run and measured cases (tune.dryrun, tune.measure) and
the benchmarks (the device baseline's AdamW on each kernel lever included).
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.zero import zero_units
from .kfac import KFAC, KFACSettings


def optimizer_for(model: nn.Module, options, lr: float, mesh=None,
                  grad_accum: int = 1) -> torch.optim.Optimizer:
    """The run's optimizer for `model`: `build_optimizer` over the tensors `build_optimizer_for`
    finds, and with `options.name == "kfac"` K-FAC's preconditioning in front of it (which needs
    the `mesh` and the micro-batches per step, `grad_accum`)."""
    device = mesh.device if mesh is not None else None
    optimizer = build_optimizer_for(
        model, lambda params: build_optimizer(params, options, lr, device=device))
    if options.name != "kfac":
        return optimizer
    return KFAC(model, optimizer, mesh, KFACSettings.from_options(options), grad_accum)


def build_optimizer_for(model: nn.Module, build) -> torch.optim.Optimizer:
    """`build(params)` over the tensors this model's optimizer must step, wired to the model.

    Plain, DDP and FSDP2 models: the model's trainable parameters. ZeRO-1/2: the rank's shards,
    with the post-step all-gather registered.
    """
    units = zero_units(model)
    if units:
        optimizer = build([p for unit in units for p in unit.shard_parameters()])
        for unit in units:
            unit.bind_optimizer(optimizer)
        return optimizer
    return build([p for p in model.parameters() if p.requires_grad])


def build_optimizer(params, options, lr: float, impl: str | None = None,
                    device: torch.device | None = None) -> torch.optim.Optimizer:
    """The torch optimizer `options.name` names over `params` (K-FAC: its first-order base,
    `options.kfac_base`, which `optimizer_for` wraps), at learning rate `lr`, on the kernel
    `impl` picks (default: `options.impl`; see `optimizer_kernel`; `device`: the rank's, for a
    rank with no parameters)."""
    name = options.kfac_base if options.name == "kfac" else options.name
    params = list(params)
    impl = impl if impl is not None else getattr(options, "impl", "auto")
    kernel = optimizer_kernel(params, impl, sgd=name == "sgd", device=device)
    # a rank may hold nothing to train (a pipeline stage of frozen layers, a pretrained trunk):
    # torch refuses an empty list of tensors, and steps an empty group
    params = params or [{"params": []}]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.momentum,
                               weight_decay=options.weight_decay, **kernel)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(options.betas), eps=options.eps,
               weight_decay=options.weight_decay, **kernel)


def optimizer_kernel(params: list, impl: str, sgd: bool = False,
                     device: torch.device | None = None) -> dict:
    """torch.optim's implementation for `optim.impl`: "auto" takes the fused kernel (one launch
    for every parameter, and a step it can skip on the device) wherever torch has one for these
    parameters (plain floating-point tensors on a GPU; on a CPU for Adam and AdamW), else
    torch's own choice. On a CPU, SGD keeps the for-loop kernel: torch 2.13's fused CPU SGD
    disagreed with it by 5e-4 (relative, one step) under 3D tensor parallelism with activation
    checkpointing, where every parameter and gradient was contiguous (cause not found)."""
    plain = all(type(p) in (torch.Tensor, nn.Parameter) and p.is_floating_point()
                and p.device.type in ("cpu", "cuda") for p in params)
    # no parameters (a pipeline stage of frozen layers): the kernel its peers on `device` take,
    # so that every rank decides alike whether the step is skipped on the device
    on_cpu = any(p.device.type == "cpu" for p in params) if params else \
        device is None or device.type == "cpu"
    if impl == "fused" or (impl == "auto" and plain and not (sgd and on_cpu)):
        return {"fused": True}
    return {"foreach": True} if impl == "foreach" else {"foreach": False} if impl == "forloop" \
        else {}


def match_grad_layouts(params) -> None:
    """Give every gradient its parameter's strides. torch's fused optimizers walk parameter and
    gradient memory in step, assuming the two are laid out alike, which autograd's gradients are
    but gradients a strategy assigns need not be (seen with torch 2.13's fused CPU SGD and AdamW:
    a transposed gradient gave updates off by 0.5-1.0). A host-side check of strides per
    parameter; a copy only where they differ."""
    for p in params:
        g = p.grad
        if g is not None and g.stride() != p.stride() and type(g) is torch.Tensor:
            aligned = torch.empty_like(p)
            aligned.copy_(g)
            p.grad = aligned


def supports_found_inf(optimizer) -> bool:
    """Whether `optimizer.step()` honours `optimizer.found_inf` (skips on the device): torch's
    fused Adam, AdamW and SGD do, as `torch.amp.GradScaler` relies on."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) and \
        bool(optimizer.defaults.get("fused"))
