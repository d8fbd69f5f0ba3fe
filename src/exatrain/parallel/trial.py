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
    """Within: forwards of `modules` that step no state the run sees afterwards. Each module's
    buffers are put back as they were, the objects themselves (a forward may assign a new
    tensor, or a fake one) with their values; the random streams of the devices the modules
    live on are forked."""
    from torch.nn.parameter import is_lazy

    tables, values = [], []
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            tables.append((module, dict(module._buffers)))
            values += [(b, b.detach().clone()) for b in module._buffers.values()
                       if b is not None and not is_lazy(b)]
    devices = sorted({t.device.index or 0 for root in modules
                      for t in (*root.parameters(), *root.buffers()) if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for module, table in tables:
                module._buffers.clear()
                module._buffers.update(table)
            for buffer, value in values:
                buffer.copy_(value)


@contextlib.contextmanager
def probing(model: nn.Module):
    """Within: forwards of `model` that inspect it (the set-up checks): no trace left
    (`leaves_no_trace`), evaluation mode (`evaluating`), compiled code run eagerly (a probe
    compiles nothing the run would not)."""
    with leaves_no_trace([model]), evaluating(model), torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def evaluating(*models: nn.Module):
    """Within: `models` in evaluation mode (samples independent: no dropout, norm layers on their
    running statistics); each module's own mode is put back after, as it was."""
    modes = [(m, m.training) for model in models for m in model.modules()]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training
