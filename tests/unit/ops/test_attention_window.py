"""Sliding-window attention: the reference against a mask built from the definition,
and every CPU implementation (SDPA, CPU flash with the LSE) against the reference."""

import pytest
import torch

from mtcore.ops import attention, attention_lse
from mtcore.ops.flash_lse import cpu_flash_attention_lse
from mtcore.ops.torch_native import sdpa_attention


def _qkv(b, hq, hkv, sq, sk, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_()
        for h, s in ((hq, sq), (hkv, sk), (hkv, sk))
    ]


def _by_definition(q, k, v, window):
    """Query i (at key position i + sk - sq) attends key j iff 0 <= pos - j < window:
    a plain softmax over those keys, written out per row."""
    sq, sk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kf, vf = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    rows = []
    for i in range(sq):
        pos = i + sk - sq
        lo = max(0, pos - window + 1)
        logits = q[:, :, i : i + 1] @ kf[:, :, lo : pos + 1].transpose(-1, -2)
        logits = logits / q.shape[-1] ** 0.5
        rows.append(torch.softmax(logits, -1) @ vf[:, :, lo : pos + 1])
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("sq,sk,window", [(9, 9, 3), (4, 10, 2), (7, 7, 1), (6, 6, 20)])
def test_reference_window_is_the_definition(sq, sk, window):
    q, k, v = _qkv(2, 4, 2, sq, sk, 8)
    got = attention(q, k, v, causal=True, window=window)
    torch.testing.assert_close(got, _by_definition(q, k, v, window), rtol=1e-12, atol=1e-12)
    out, lse = attention_lse(q, k, v, True, None, None, window)
    assert torch.equal(out, got)
    assert torch.isfinite(lse).all()


def test_a_window_changes_the_result_and_a_wide_one_does_not():
    q, k, v = _qkv(1, 2, 2, 8, 8, 4, seed=1)
    full = attention(q, k, v, causal=True)
    assert not torch.allclose(attention(q, k, v, causal=True, window=3), full)
    assert torch.equal(attention(q, k, v, causal=True, window=8), full)


@pytest.mark.parametrize(
    "impl", [sdpa_attention, lambda *a, **kw: cpu_flash_attention_lse(*a, **kw)[0]]
)
@pytest.mark.parametrize("sq,sk", [(12, 12), (5, 12)])
def test_cpu_kernels_match_the_reference_forward_and_backward(impl, sq, sk):
    pad = torch.ones(2, sk, dtype=torch.bool)
    pad[1, sk - 3] = False
    q, k, v = _qkv(2, 4, 2, sq, sk, 16, seed=2, dtype=torch.float32)
    want = attention(q, k, v, True, pad, None, 4)
    got = impl(q, k, v, True, pad, None, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(want)
    want_g = torch.autograd.grad(want, (q, k, v), grad)
    got_g = torch.autograd.grad(got, (q, k, v), grad)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cpu_flash_lse_matches_the_reference_lse():
    q, k, v = _qkv(1, 2, 2, 10, 10, 8, seed=3, dtype=torch.float32)
    _, want = attention_lse(q, k, v, True, None, None, 3)
    _, got = cpu_flash_attention_lse(q, k, v, True, None, None, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(causal=False, window=3), dict(window=0), dict(window=True)])
def test_window_needs_causal_and_a_positive_size(bad):
    q, k, v = _qkv(1, 1, 1, 4, 4, 4)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, **bad)


@pytest.mark.parametrize("window", [None, 12, 5])
def test_sdpa_decode_step_matches_the_reference(window):
    """One query after a cache (sq = 1): the last position sees every key (or its window)."""
    q, k, v = _qkv(2, 4, 2, 1, 12, 16, seed=4, dtype=torch.float32)
    want = attention(q, k, v, True, None, None, window)
    torch.testing.assert_close(sdpa_attention(q, k, v, True, None, None, window), want)
    if window == 5:
        assert not torch.allclose(want, attention(q, k, v, True))
