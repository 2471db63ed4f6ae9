"""The cpu backend's torch-native rms_norm, layer_norm, cross_entropy, rope and swiglu against the reference
ops (the spec): forward and backward, float32 and bfloat16, the edge cases of each
contract; the cpu backend serves them, and ``MTCORE_KERNELS=reference`` gives the
reference's numbers again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.backend.kernels import KernelQuery
from mtcore.ops import cross_entropy, layer_norm, rms_norm, rope, rope_tables, swiglu
from mtcore.ops.torch_native import (
    fused_cross_entropy,
    fused_layer_norm_fp32,
    fused_rms_norm,
    rms_norm_fp32,
    rope_rotation,
    silu_glu_fp32,
)


def _randn(seed, *shape, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _grads(fn, inputs, grad_out):
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _close(a, b, dtype):
    if dtype == torch.bfloat16:  # both round once from float32: at most one bf16 ulp apart
        torch.testing.assert_close(
            a.float(), b.float(), rtol=2**-7, atol=1e-3 * b.abs().max().item()
        )
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(b.abs().max().item(), 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_the_reference_in_every_dtype(dtype, with_bias):
    x = _randn(1, 3, 7, 96, dtype=dtype, scale=2.0) + 3.0
    w, b = _randn(2, 96, dtype=dtype), _randn(3, 96, dtype=dtype)
    inputs = [x, w, b] if with_bias else [x, w]
    grad_out = _randn(4, 3, 7, 96)

    def call(fn):
        return lambda x, w, b=None: fn(x, w, b, 1e-5)

    got, got_grads = _grads(call(fused_layer_norm_fp32), inputs, grad_out)
    want, want_grads = _grads(call(layer_norm), inputs, grad_out)
    assert got.dtype == dtype
    _close(got, want, dtype)
    for a, b_ in zip(got_grads, want_grads, strict=True):
        assert a.dtype == dtype
        _close(a, b_, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_the_reference_with_ignored_rows(dtype):
    logits = _randn(5, 40, 300, dtype=dtype, scale=4.0)
    target = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(6))
    target[[3, 17]] = -100
    grad_out = _randn(7, 40)
    got, (g_got,) = _grads(lambda x: fused_cross_entropy(x, target), [logits], grad_out)
    want, (g_want,) = _grads(lambda x: cross_entropy(x, target), [logits], grad_out)
    assert got.dtype == torch.float32  # float32 losses from bf16 logits, as the contract says
    _close(got, want, torch.float32)
    assert torch.equal(got[[3, 17]], torch.zeros(2))
    assert g_got.dtype == dtype and torch.equal(g_got[[3, 17]], torch.zeros(2, 300, dtype=dtype))
    _close(g_got, g_want, dtype)


def test_cross_entropy_ignore_index_may_be_a_valid_class():
    logits, target = _randn(8, 6, 10), torch.tensor([7, 1, 7, 2, 0, 9])
    got = fused_cross_entropy(logits, target, ignore_index=7)
    torch.testing.assert_close(got, cross_entropy(logits, target, ignore_index=7))
    assert got[0] == 0 and got[2] == 0


def test_cross_entropy_rejects_bad_input_like_the_reference():
    with pytest.raises(ValueError, match="int64"):
        fused_cross_entropy(torch.randn(3, 5), torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        fused_cross_entropy(torch.randn(3), torch.tensor([1, 2, 3]))
    with pytest.raises((IndexError, RuntimeError)):
        fused_cross_entropy(torch.randn(2, 5), torch.tensor([1, 5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_forward_is_the_reference_bit_for_bit_and_backward_matches(dtype):
    cos, sin = rope_tables(11, 16, offset=3)
    x, grad_out = _randn(9, 2, 11, 3, 16, dtype=dtype), _randn(10, 2, 11, 3, 16)
    got, (g_got,) = _grads(lambda x: rope_rotation(x, cos, sin), [x], grad_out)
    want, (g_want,) = _grads(lambda x: rope(x, cos, sin), [x], grad_out)
    assert torch.equal(got, want)
    assert g_got.dtype == dtype
    _close(g_got, g_want, dtype)


def test_rope_differentiates_the_tables_when_they_require_grad():
    cos, sin = rope_tables(5, 8)
    x, grad_out = _randn(11, 3, 5, 2, 8), _randn(12, 3, 5, 2, 8)
    _, got = _grads(rope_rotation, [x, cos, sin], grad_out)
    _, want = _grads(rope, [x, cos, sin], grad_out)
    assert len(got) == 3
    for a, b in zip(got, want, strict=True):
        _close(a, b, torch.float32)


def test_rope_bad_shapes_get_the_reference_errors():
    cos, sin = rope_tables(5, 8)
    with pytest.raises(ValueError, match="head_dim"):
        rope_rotation(torch.randn(1, 5, 2, 7), cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        rope_rotation(torch.randn(1, 4, 2, 8), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_reference_in_every_dtype(dtype):
    x, grad_out = _randn(16, 3, 5, 66, dtype=dtype, scale=3.0), _randn(17, 3, 5, 33)
    got, (g_got,) = _grads(silu_glu_fp32, [x], grad_out)
    want, (g_want,) = _grads(swiglu, [x], grad_out)
    assert got.dtype == g_got.dtype == dtype
    _close(got, want, dtype)
    _close(g_got, g_want, dtype)
    with pytest.raises(ValueError, match="even last dim"):
        silu_glu_fp32(torch.randn(2, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 66), (67, 34), (0, 8)])
def test_swiglu_gives_the_bits_autograd_gives_through_chunk_and_silu(dtype, shape):
    """The hand-written backward (one gradient buffer, no ``cat``) is autograd's own
    arithmetic: output and gradient equal bit for bit, odd halves and no rows included."""

    def composite(x):
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    x = _randn(18, *shape, dtype=dtype, scale=3.0)
    grad_out = _randn(19, *shape[:-1], shape[-1] // 2, dtype=dtype)
    got, (g_got,) = _grads(silu_glu_fp32, [x], grad_out)
    want, (g_want,) = _grads(composite, [x], grad_out)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_in_every_dtype(dtype):
    x, w = _randn(21, 2, 5, 96, dtype=dtype, scale=3.0), _randn(22, 96, dtype=dtype)
    grad_out = _randn(23, 2, 5, 96)
    got, got_grads = _grads(lambda x, w: rms_norm_fp32(x, w, 1e-6), [x, w], grad_out)
    want, want_grads = _grads(lambda x, w: rms_norm(x, w, 1e-6), [x, w], grad_out)
    assert got.dtype == dtype
    _close(got, want, dtype)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.dtype == dtype
        _close(a, b, dtype)


def test_rms_norm_forward_is_torch_bit_for_bit_and_backward_passes_gradcheck():
    x, w = _randn(24, 3, 7, 64, scale=2.0), _randn(25, 64)
    assert torch.equal(rms_norm_fp32(x, w, 1e-6), fused_rms_norm(x, w, 1e-6))
    x64, w64 = (t.double().requires_grad_() for t in (_randn(26, 2, 3, 8), _randn(27, 8)))
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_fp32(x, w, 1e-6), (x64, w64))
    frozen = _randn(28, 64).requires_grad_(False)  # a frozen weight: only dx
    leaf = x.clone().requires_grad_()
    rms_norm_fp32(leaf, frozen, 1e-6).sum().backward()
    assert leaf.grad is not None and frozen.grad is None


def test_rms_norm_bad_weight_gets_torchs_error():
    with pytest.raises(RuntimeError):
        rms_norm_fp32(_randn(29, 4, 64), _randn(30, 32), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backend_serves_them_and_reference_mode_restores_the_spec(monkeypatch, dtype):
    monkeypatch.delenv("MTCORE_KERNELS", raising=False)
    native = select_backend("cpu").kernels
    served = native.table(KernelQuery("cpu", dtype))
    ops = ("rms_norm", "layer_norm", "cross_entropy", "rope", "swiglu")
    assert [served[op][0].fn for op in ops] == [
        rms_norm_fp32,
        fused_layer_norm_fp32,
        fused_cross_entropy,
        rope_rotation,
        silu_glu_fp32,
    ]
    monkeypatch.setenv("MTCORE_KERNELS", "reference")
    reference = select_backend("cpu").kernels
    x, w, b = _randn(13, 4, 64, dtype=dtype), _randn(14, 64), _randn(15, 64)
    target, (cos, sin) = torch.tensor([1, 0, 63, 5]), rope_tables(4, 32)
    specs = (
        layer_norm(x, w, b, 1e-5),
        cross_entropy(x, target),
        rope(x.view(1, 4, 2, 32), cos, sin),
    )
    for kernels, exact in ((native, False), (reference, True)):
        outs = (
            kernels.layer_norm(x, w, b, 1e-5),
            kernels.cross_entropy(x, target, -100),
            kernels.rope(x.view(1, 4, 2, 32), cos, sin),
        )
        for got, want in zip(outs, specs, strict=True):
            if exact:
                assert torch.equal(got, want)
            else:
                _close(got, want, got.dtype)
