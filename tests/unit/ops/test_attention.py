"""attention against F.scaled_dot_product_attention with explicit boolean masks."""

import pytest
import torch
import torch.nn.functional as F

from mtcore.ops import attention


def _allowed(b, sq, sk, causal, kpm):
    """Explicit [b, 1, sq, sk] mask; bottom-right causal is tril with diagonal sk - sq."""
    m = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        m = m.tril(diagonal=sk - sq)
    m = m.expand(b, 1, sq, sk)
    if kpm is not None:
        m = m & kpm[:, None, None, :]
    return m


def _sdpa_ref(q, k, v, causal, kpm, scale):
    b, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    allowed = _allowed(b, sq, k.shape[2], causal, kpm)
    has_key = allowed.any(-1, keepdim=True)
    # SDPA leaves rows without keys undefined; give them every key, then zero them.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, scale=scale)
    return torch.where(has_key, out, torch.zeros_like(out))


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_()
        for h, s in ((hq, sq), (hkv, sk), (hkv, sk))
    ]


CASES = {
    # name: (b, hq, hkv, sq, sk, d, causal, kpm or None, scale)
    "mha_causal_square": (2, 2, 2, 6, 6, 8, True, None, None),
    "gqa_noncausal": (2, 4, 2, 5, 7, 8, False, None, None),
    "mqa_causal_sq_lt_sk": (1, 4, 1, 3, 8, 16, True, None, 0.3),
    "causal_sq_gt_sk_empty_rows": (1, 2, 1, 6, 4, 8, True, None, None),
    "gqa_causal_left_padding": (2, 6, 3, 6, 6, 8, True, [[1] * 6, [0, 0, 0, 1, 1, 1]], None),
    "noncausal_all_padded_batch": (2, 2, 1, 4, 5, 8, False, [[1, 1, 0, 1, 0], [0] * 5], None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_fp32_matches_sdpa(case):
    b, hq, hkv, sq, sk, d, causal, kpm, scale = CASES[case]
    kpm = None if kpm is None else torch.tensor(kpm, dtype=torch.bool)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d)
    ours = attention(q, k, v, causal=causal, key_padding_mask=kpm, scale=scale)
    ref = _sdpa_ref(q, k, v, causal, kpm, scale)
    assert ours.shape == (b, hq, sq, d) and ours.dtype == torch.float32
    # Both fp32; SDPA's CPU kernel blocks the softmax differently: ~1e-6 absolute.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(ours.shape)
    g_ours = torch.autograd.grad(ours, (q, k, v), gy)
    g_ref = torch.autograd.grad(ref, (q, k, v), gy)
    for a, r in zip(g_ours, g_ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_fully_masked_rows_are_exactly_zero_with_zero_grad():
    q, k, v = _qkv(1, 2, 2, 6, 4, 8)  # causal, sq > sk: the first two queries see no key
    out = attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert not torch.equal(out[:, :, 2:], torch.zeros_like(out[:, :, 2:]))
    # Anomaly mode raises if any backward node produces NaN, even one later masked.
    with torch.autograd.detect_anomaly():
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(gq[:, :, :2], torch.zeros_like(gq[:, :, :2]))
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))


def test_causal_square_is_top_left_and_last_query_sees_all():
    q, k, v = _qkv(1, 1, 1, 4, 4, 8)
    v = torch.eye(4, 8)[None, None].clone()  # output row = attention weights over keys
    out = attention(q, k, v, causal=True)
    weights = out[0, 0, :, :4]
    assert torch.equal(weights.triu(1), torch.zeros(4, 4))
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))


def test_attention_bf16():
    q, k, v = _qkv(2, 4, 2, 5, 7, 32, dtype=torch.bfloat16)
    kpm = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ours = attention(q, k, v, causal=True, key_padding_mask=kpm)
    ref = _sdpa_ref(q.float(), k.float(), v.float(), True, kpm, None).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    # Same bf16 inputs, fp32 compute on both sides, one rounding each: <= 1 bf16 ulp (2^-8).
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-8, atol=2**-10)


def test_attention_gradcheck_fp64():
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(1, 2, 1, 3, 4, 4))
    kpm = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda a, b, c: attention(a, b, c, causal=True, key_padding_mask=kpm), (q, k, v)
    )


def test_attention_validates_shapes():
    q, k, v = _qkv(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)
    q, k, v = _qkv(1, 4, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, k, v, key_padding_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, k, v, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        attention(q[0], k, v)
