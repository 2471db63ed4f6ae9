"""attention_lse and merge_attention: blocks of keys merged exactly, forward and backward."""

from __future__ import annotations

import pytest
import torch

from mtcore.ops import attention, attention_lse, merge_attention


def _qkv(b=2, hq=4, hkv=2, sq=6, sk=6, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(b, hq, sq, d), make(b, hkv, sk, d), make(b, hkv, sk, d)


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(*out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad_out)


def test_output_is_attention_bit_for_bit_and_lse_is_logsumexp():
    q, k, v = _qkv(dtype=torch.float32)
    mask = torch.tensor([[True] * 6, [True, True, False, True, False, False]])
    out, lse = attention_lse(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.equal(out, attention(q, k, v, causal=True, key_padding_mask=mask))
    assert lse.shape == (2, 4, 6) and lse.dtype == torch.float32
    kf = k.repeat_interleave(2, dim=1)
    logits = (q @ kf.transpose(-1, -2)) / 8**0.5
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    want = torch.logsumexp(logits.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse, want)


@pytest.mark.parametrize("causal", [True, False])
def test_merge_of_key_blocks_equals_full_attention_forward_and_backward(causal):
    """Keys split into two blocks at random points: the merged result is attention over
    all keys. Causal: the first block's keys are the prefix, the queries the suffix of
    the sequence, so block 2 is the bottom-right-aligned causal block."""
    q, k, v = _qkv(sq=5, sk=9, seed=3)
    mask = torch.rand(2, 9, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[:, -1] = True
    full, full_lse = attention_lse(q, k, v, causal=causal, key_padding_mask=mask)
    want = _grads(full, (q, k, v))
    # Causal: the queries are positions 4..8, so each sees keys [0, cut <= 4) whole.
    for cut in (1, 3, 4) if causal else (1, 4, 8):
        a = attention_lse(q, k[:, :, :cut], v[:, :, :cut], False, mask[:, :cut])
        b = attention_lse(q, k[:, :, cut:], v[:, :, cut:], causal, mask[:, cut:])
        out, lse = merge_attention(*a, *b)
        torch.testing.assert_close(out, full.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
        got = _grads(out, (q, k, v))
        for name, x, y in zip("qkv", got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=f"d{name}, cut {cut}")


def test_fully_masked_rows_merge_to_zero_without_nan():
    """A row with no key in one block takes the other block's result; a row with no key
    anywhere is (0, -inf), and no gradient is NaN."""
    q, k, v = _qkv(b=2, sq=4, sk=6, seed=5)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False  # batch 0: no key in the first block
    mask[1] = False  # batch 1: no key at all
    a = attention_lse(q, k[:, :, :3], v[:, :, :3], False, mask[:, :3])
    b = attention_lse(q, k[:, :, 3:], v[:, :, 3:], False, mask[:, 3:])
    assert torch.isneginf(a[1][0]).all() and (a[0][0] == 0).all()
    out, lse = merge_attention(*a, *b)
    full, full_lse = attention_lse(q, k, v, False, mask)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    g_lse = torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0.0)
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), g_lse))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][1] == 0).all(), "a query with no key gets no gradient"


def test_merge_is_order_free_and_keeps_dtype():
    q, k, v = _qkv(dtype=torch.float32, seed=6)
    a = attention_lse(q, k[:, :, :2], v[:, :, :2], False)
    b = attention_lse(q, k[:, :, 2:], v[:, :, 2:], False)
    ab, ba = merge_attention(*a, *b), merge_attention(*b, *a)
    torch.testing.assert_close(ab[0], ba[0])
    assert ab[0].dtype == torch.float32 and ab[1].dtype == torch.float32
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    out, lse = attention_lse(qb, kb, vb, True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
