"""swiglu against silu(gate) * up written with torch's own silu."""

import pytest
import torch
import torch.nn.functional as F

from mtcore.ops import swiglu


def _ref(x):
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def test_swiglu_fp32_forward_backward():
    x = torch.randn(3, 4, 10, requires_grad=True)
    ours, ref = swiglu(x), _ref(x)
    assert ours.shape == (3, 4, 5)
    # Same fp32 math, different op split: a couple of ulps.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn(ours.shape)
    (g1,) = torch.autograd.grad(ours, x, gy)
    (g2,) = torch.autograd.grad(ref, x, gy)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_swiglu_bf16_is_fp32_rounded_once():
    x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    ours = swiglu(x)
    ref = _ref(x.float()).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    # One rounding of fp32 values that may differ in the last fp32 bit: <= 1 bf16 ulp,
    # which is 2**-8 to 2**-7 of the value (2**-8 alone failed on values just above a
    # power of two).
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-6)


def test_swiglu_gradcheck_fp64():
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x,))


def test_swiglu_odd_dim_raises():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 5))
