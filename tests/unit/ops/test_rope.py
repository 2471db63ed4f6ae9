"""rope against a complex-number formulation; rope_tables against its formula."""

import math

import pytest
import torch

from mtcore.ops import rope, rope_tables


def _complex_rope(x, radius, angles):
    """Independent spec: pair (x1[i], x2[i]) is the complex x1 + i*x2, times radius*e^{i*angle}."""
    half = x.shape[-1] // 2
    z = torch.view_as_complex(torch.stack((x[..., :half], x[..., half:]), dim=-1).contiguous())
    rot = torch.polar(radius, angles)[None, :, None, :]
    out = torch.view_as_real(z * rot)
    return torch.cat((out[..., 0], out[..., 1]), dim=-1)


def _angles(seq, d, theta=10000.0, offset=0):
    inv = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    return torch.tensor(
        [[p * f for f in inv] for p in range(offset, offset + seq)], dtype=torch.float64
    )


def test_tables_match_formula():
    cos, sin = rope_tables(7, 16, theta=500.0, offset=3)
    assert cos.shape == sin.shape == (7, 8) and cos.dtype == sin.dtype == torch.float32
    ang = _angles(7, 16, theta=500.0, offset=3)
    # float64 angles rounded once to float32: within half an fp32 ulp of the true value.
    torch.testing.assert_close(cos, ang.cos().float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, ang.sin().float(), rtol=0, atol=1e-7)


def test_tables_offset_is_a_slice():
    cos, sin = rope_tables(20, 8)
    c2, s2 = rope_tables(5, 8, offset=15)
    assert torch.equal(cos[15:], c2) and torch.equal(sin[15:], s2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rope_forward_backward_matches_complex(dtype):
    b, s, h, d = 2, 6, 3, 8
    x = torch.randn(b, s, h, d, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(s, d)
    ours = rope(x, cos, sin)
    # The reference rotates by exactly the fp32 table entries (whose radius is 1 only
    # to fp32 precision), so the two differ only in formulation.
    c, s_ = cos.double(), sin.double()
    xr = x.detach().double().requires_grad_()
    ref = _complex_rope(xr, torch.hypot(c, s_), torch.atan2(s_, c))
    assert ours.dtype == dtype
    # fp32: a few ulps from the different arithmetic order.
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol)
    gy = torch.randn(ours.shape, dtype=torch.float64)
    (gx,) = torch.autograd.grad(ours, x, gy.to(dtype))
    (gr,) = torch.autograd.grad(ref, xr, gy)
    torch.testing.assert_close(gx.double(), gr, rtol=tol, atol=tol)


def test_rope_bf16_is_fp32_rounded_once():
    x = torch.randn(1, 5, 2, 64).to(torch.bfloat16)
    cos, sin = rope_tables(5, 64)
    ours = rope(x, cos, sin)
    ref = rope(x.float(), cos, sin).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, ref)


def test_rope_gradcheck_fp64():
    x = torch.randn(1, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(3, 4)
    assert torch.autograd.gradcheck(lambda t: rope(t, cos, sin), (x,))


def test_rope_preserves_norm_and_relative_position():
    d = 16
    cos, sin = rope_tables(12, d)
    q = torch.randn(1, 1, 1, d, dtype=torch.float64).expand(1, 12, 1, d)
    k = torch.randn(1, 1, 1, d, dtype=torch.float64).expand(1, 12, 1, d)
    rq, rk = rope(q, cos, sin), rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # <rope(q, m), rope(k, n)> depends on m - n only; tables are fp32, hence 1e-6.
    dots = rq[0, :, 0] @ rk[0, :, 0].T
    torch.testing.assert_close(dots[5, 2], dots[9, 6], rtol=1e-6, atol=1e-6)
    assert not math.isclose(dots[5, 2].item(), dots[5, 3].item())


def test_rope_validates_shapes():
    cos, sin = rope_tables(4, 8)
    with pytest.raises(ValueError, match="head_dim"):
        rope(torch.randn(1, 4, 1, 7), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rope(torch.randn(1, 5, 1, 8), cos, sin)
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        rope(torch.randn(4, 8), cos, sin)
    with pytest.raises(ValueError):
        rope_tables(4, 7)
