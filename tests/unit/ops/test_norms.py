"""rms_norm / layer_norm against torch's own ops, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from mtcore.ops import layer_norm, rms_norm


def _inputs(dtype, shape=(3, 5, 64)):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(shape[-1], generator=g) * 0.5 + 1).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    return x, w, b


def _grads(out, tensors):
    g = torch.Generator().manual_seed(2)
    gy = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, [t for t in tensors if t is not None], gy)


def test_rms_norm_fp32_matches_torch():
    x, w, _ = _inputs(torch.float32)
    ours = rms_norm(x, w, eps=1e-6)
    ref = F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    # fp32 on both sides; only reduction order differs (a few ulps).
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(ours, [x, w]), _grads(ref, [x, w]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_bf16_is_fp32_rounded_once():
    x, w, _ = _inputs(torch.bfloat16, shape=(4, 4096))
    ours = rms_norm(x, w)
    ref = F.rms_norm(x.float(), (4096,), w.float(), eps=1e-6).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    # Both are one rounding of (nearly) the same fp32 value: at most 1 bf16 ulp (2^-8 rel).
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-8, atol=1e-6)


def test_rms_norm_gradcheck_fp64():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    # float64 inputs are computed in float64, so finite differences are exact enough.
    assert torch.autograd.gradcheck(rms_norm, (x, w))


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_fp32_matches_torch(with_bias):
    x, w, b = _inputs(torch.float32)
    b = b if with_bias else None
    ours = layer_norm(x, w, b, eps=1e-5)
    ref = F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, c in zip(_grads(ours, [x, w, b]), _grads(ref, [x, w, b]), strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_layer_norm_bf16_is_fp32_rounded_once():
    x, w, b = _inputs(torch.bfloat16, shape=(4, 4096))
    ours = layer_norm(x, w, b)
    ref = F.layer_norm(x.float(), (4096,), w.float(), b.float(), eps=1e-5).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    # One rounding each of near-identical fp32 values: within 1 bf16 ulp.
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-8, atol=1e-2 * 2**-8)


def test_layer_norm_gradcheck_fp64():
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer_norm, (x, w, b))


def test_weight_shape_checked():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(4))
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, torch.ones(8), torch.zeros(7))
