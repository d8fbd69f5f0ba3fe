import math

import pytest

from exatrain.optim.schedule import lr_at, scaled_lr


def test_large_batch_scaling_rules():
    assert scaled_lr(1e-3, 1024, 256, "linear") == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 1024, 256, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 1024, 256, "none") == 1e-3
    assert scaled_lr(1e-3, 1024, 0, "linear") == 1e-3  # no base batch: nothing to scale from


def test_warmup_then_decay():
    lrs = [lr_at(s, 1.0, 100, 10, "cosine") for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] < 0.01
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(55, 1.0, 100, 10, "linear") == pytest.approx(0.5)
    assert lr_at(99, 1.0, 100, 0, "constant") == 1.0
    assert lr_at(100, 2.0, 100, 0, "cosine", min_lr_ratio=0.1) == pytest.approx(0.2)
    assert math.isfinite(lr_at(0, 1.0, 1, 0, "cosine"))
