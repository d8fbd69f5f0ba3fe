"""A forward that only inspects a model leaves no trace in the run (`leaves_no_trace`).

Setting a model up runs forwards that are not training: the pipeline's stage shapes (fake
tensors), its time-balanced split (timed layers), the search for weights read outside their
layers (parallel/reads.py). Such a forward in training mode would still step the model's state:
BatchNorm's running statistics and `num_batches_tracked` (fake execution too steps that integer
in place), a spectral norm's power-iteration vectors, dropout's and the user's own random draws.
A run would then start from a different state than one process does. Around such a forward,
every buffer is put back as it was and the random streams are forked. No communication.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def leaves_no_trace(modules: list[nn.Module]):
    """Within: forwards of `modules` that step no state the run sees afterwards."""
    seen: set[int] = set()
    buffers = []
    for module in modules:
        for buffer in module.buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                buffers.append((buffer, buffer.detach().clone()))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
