"""Is this a DTensor? The one test of it in exatrain, and the rank's local piece of one.

FSDP2's parameters and gradients, DTensor tensor parallelism and DCP's loaded state are DTensors;
everything else is a plain tensor. The test imports nothing: where `torch.distributed.tensor` was
never imported no DTensor can exist, and importing it (it pulls in the whole DTensor dispatch)
would slow every process that never uses one.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (subclasses included)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's local piece of a DTensor (`to_local()`); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t
