"""The global gradient norm on one process: equal to torch's, and clipping as torch clips, in the
usual one-group case (three kernels) and with gradients of several dtypes (a sum of groups); the
finiteness check that stands in for the norm where nothing else needs it."""

from __future__ import annotations

import math

import pytest
import torch

from exatrain.optim.gradnorm import clip_grad_norm_, decided_locally, found_nonfinite


def _params(dtypes) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for i, dtype in enumerate(dtypes):
        drawn = dtype if dtype.is_complex else torch.float32   # complex: both parts drawn
        p = torch.nn.Parameter(torch.randn(3 + i, 5, generator=generator, dtype=drawn).to(dtype))
        p.grad = torch.randn(p.shape, generator=generator, dtype=drawn).to(dtype) * (i + 1)
        params.append(p)
    params.append(torch.nn.Parameter(torch.ones(2)))  # no gradient: takes no part in the norm
    return params


def _real(g: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(g) if g.is_complex() else g.float()


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 4,
                                    (torch.float32, torch.bfloat16, torch.float32, torch.float16),
                                    (torch.float32, torch.complex64, torch.complex64)])
def test_norm_and_clipping_equal_torchs(dtypes):
    """Complex gradients (a Fourier layer's weights) count |z|² = re² + im²."""
    ours, theirs = _params(dtypes), _params(dtypes)
    expected = torch.nn.utils.get_total_norm(
        [_real(p.grad) for p in theirs if p.grad is not None]).double()
    norm = clip_grad_norm_(ours)  # no clipping: the norm only, gradients untouched
    assert norm.dtype == torch.float64 and norm.shape == ()
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs) if a.grad is not None)

    # torch's formula, grad * min(1, max_norm / (norm + 1e-6)), with the exact norm (torch's own
    # clip_grad_norm_ sums low-precision groups' norms in their dtype: a coarser norm)
    clip_grad_norm_(ours, max_norm=1.0)
    factor = min(1.0, 1.0 / (expected.item() + 1e-6))
    for a, b in zip(ours, theirs):
        if a.grad is not None:
            wide = torch.complex128 if b.grad.is_complex() else torch.float64
            exact = (b.grad.to(wide) * factor).to(b.dtype)
            low = a.dtype != torch.float32
            torch.testing.assert_close(a.grad, exact, rtol=1e-2 if low else 1e-6,
                                       atol=1e-2 if low else 1e-7)


def test_a_non_finite_gradient_gives_a_non_finite_norm():
    params = _params((torch.float32,) * 3)
    params[1].grad[0, 0] = math.inf
    assert not torch.isfinite(clip_grad_norm_(params))
    params[1].grad[0, 0] = math.nan
    assert torch.isnan(clip_grad_norm_(params, max_norm=1.0))


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3,
                                    (torch.float32, torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
def test_the_finiteness_check_flags_any_inf_or_nan_and_leaves_the_gradients_alone(dtypes, bad):
    params = _params(dtypes)
    if bad is not None:
        params[2].grad[1, 3] = bad
    before = [p.grad.clone() for p in params if p.grad is not None]
    flag = found_nonfinite(params)
    assert flag.dtype == torch.float32 and flag.shape == ()
    assert flag.item() == (0.0 if bad is None else 1.0)
    for after, was in zip((p.grad for p in params if p.grad is not None), before):
        torch.testing.assert_close(after, was, rtol=0, atol=0, equal_nan=True)
    assert found_nonfinite([torch.nn.Parameter(torch.ones(2))]) is None  # no gradient at all


def test_only_whole_local_gradients_decide_finiteness_on_their_own():
    params = _params((torch.float32,) * 2)
    assert decided_locally(params)
    assert not decided_locally(params, across=object())  # pipeline stages: disjoint parameters
    params[0].exatrain_norm_axes = (object(),)           # split over an axis: a slice here
    assert not decided_locally(params)
