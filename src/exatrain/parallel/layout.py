"""Memory layout of convolutional models: channels-last end to end.

cuDNN's fast convolution and BatchNorm kernels (and oneDNN's on a CPU) work on channels-last
tensors (NHWC, NDHWC). A model whose weights and inputs are laid out NCHW makes every such
layer convert its input and output (`nchwToNhwcKernel` and back on a GPU) and run BatchNorm's
NCHW kernels. `parallel.channels_last` ("auto": on for any model with 2D or 3D convolutions)
converts the weights of every module once (`to_channels_last`) and the Trainer's input path
hands the model channels-last batches (`input_memory_format`: the prefetch thread converts each
batch as it decodes it, off the training thread). The logical shapes do not change, so the model
computes the same function: only which order the elements lie in memory.

Left as they are under `space` and `tensor` (the spatial and channel/filter layers split and
exchange blocks along the logical dimensions, and their halo buffers are laid out contiguous)
and under `shard` and `pipe` (ZeRO's flat buckets and FSDP2 take contiguous parameters only;
stages send contiguous activations).
"""

from __future__ import annotations

import torch
from torch import nn

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d))
               for m in model.modules())


def wants_channels_last(model: nn.Module, setting: str, plan) -> bool:
    """Whether `parallel.channels_last` (auto | on | off) lays `model` out channels-last."""
    if setting == "off" or plan.space_degree > 1 or plan.tensor_degree > 1 or plan.shard > 1 \
            or plan.pipe > 1:
        return False
    return setting == "on" or _convolutional(model)


def to_channels_last(model: nn.Module) -> nn.Module:
    """Every 4D and 5D parameter and buffer of `model` channels-last, in place; returns it."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            layout = _FORMATS.get(tensor.dim())
            if layout is not None and not tensor.is_contiguous(memory_format=layout):
                tensor.data = tensor.data.contiguous(memory_format=layout)
    model.exatrain_channels_last = True
    return model


def input_memory_format(model: nn.Module) -> bool:
    """True when `model` (laid out by `to_channels_last`) takes channels-last inputs."""
    return any(getattr(m, "exatrain_channels_last", False) for m in model.modules())


def channels_last_input(x):
    """Every 4D or 5D tensor of the inputs `x` (one tensor, or several) as channels-last;
    anything else as it is."""
    from .nested import map_tensors
    return map_tensors(x, lambda t: t.contiguous(memory_format=_FORMATS[t.dim()])
                       if t.dim() in _FORMATS else t)


__all__ = ["channels_last_input", "input_memory_format", "to_channels_last",
           "wants_channels_last"]
