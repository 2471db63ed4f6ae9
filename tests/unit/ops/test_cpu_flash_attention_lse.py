"""cpu_flash_attention_lse (torch's CPU flash kernel) matches the reference attention_lse,
forward and backward through both outputs, with GQA, masks and fully masked rows."""

from __future__ import annotations

import pytest
import torch

from mtcore.ops import attention_lse
from mtcore.ops.torch_native import cpu_flash_attention_lse, cpu_flash_attention_lse_available

pytestmark = pytest.mark.skipif(
    not cpu_flash_attention_lse_available(), reason="torch has no CPU flash-attention backward"
)


def _inputs(sq, sk, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, sq, 8, generator=g)
    k, v = torch.randn(2, 2, sk, 8, generator=g), torch.randn(2, 2, sk, 8, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "masked"),
    [(6, 6, True, False), (6, 6, False, False), (4, 9, True, False), (6, 6, True, True), (4, 9, False, True)],
)  # fmt: skip
def test_matches_the_reference_forward_and_backward(sq, sk, causal, masked):
    q, k, v = _inputs(sq, sk, seed=sq * 10 + sk)
    mask = None
    if masked:
        mask = torch.ones(2, sk, dtype=torch.bool)
        mask[0, : sk // 2] = False
        mask[1] = False  # batch 1: no key at all
    g = torch.Generator().manual_seed(1)
    d_out, d_lse = torch.randn(2, 4, sq, 8, generator=g), torch.randn(2, 4, sq, generator=g)
    results = []
    for fn in (cpu_flash_attention_lse, attention_lse):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, causal=causal, key_padding_mask=mask)
        finite = torch.isfinite(lse)
        grads = torch.autograd.grad((out, lse), leaves, (d_out, d_lse.masked_fill(~finite, 0.0)))
        results.append((out, lse, grads))
    (out, lse, grads), (want_out, want_lse, want_grads) = results
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_bf16_keeps_dtypes():
    q, k, v = (t.bfloat16() for t in _inputs(6, 6, seed=3))
    out, lse = cpu_flash_attention_lse(q, k, v, causal=True)
    want_out, want_lse = attention_lse(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_the_conformance_kit_cases(dtype):
    """What the kit runs against a registered attention_lse (forward, backward, bias)."""
    from mtcore.testing.conformance.kernel_cases import check_op

    ran = check_op("attention_lse", cpu_flash_attention_lse, None, dtype, "cpu")
    assert len(ran) >= 4, ran
