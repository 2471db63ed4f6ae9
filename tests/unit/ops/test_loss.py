"""cross_entropy against F.cross_entropy(reduction='none')."""

import pytest
import torch
import torch.nn.functional as F

from mtcore.ops import cross_entropy


def _data(n=12, vocab=50, ignore=-100, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g) * scale).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n,), generator=g)
    target[[1, 5, 6]] = ignore
    return logits, target


@pytest.mark.parametrize("ignore", [-100, 7])
def test_cross_entropy_fp32_forward_backward(ignore):
    logits, target = _data(ignore=ignore)
    ours = cross_entropy(logits, target, ignore_index=ignore)
    ref = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore)
    assert ours.shape == (12,) and ours.dtype == torch.float32
    assert torch.equal(ours[[1, 5, 6]], torch.zeros(3))
    # Both fp32 log-softmax; only the log-sum-exp order differs.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    gy = torch.rand(12)
    (g1,) = torch.autograd.grad(ours, logits, gy)
    (g2,) = torch.autograd.grad(ref, logits, gy)
    assert torch.equal(g1[[1, 5, 6]], torch.zeros(3, 50))
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)


def test_cross_entropy_bf16_logits_computed_in_fp32():
    logits, target = _data(n=16, vocab=32000, dtype=torch.bfloat16)
    ours = cross_entropy(logits, target)
    ref = F.cross_entropy(logits.float(), target, reduction="none")
    assert ours.dtype == torch.float32
    # Same bf16 inputs upcast to fp32, so the loss agrees to fp32 precision; a bf16
    # log-sum-exp over 32k entries would be off by ~1e-2.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(ours.sum(), logits)
    (gr,) = torch.autograd.grad(ref.sum(), logits)
    assert g.dtype == torch.bfloat16
    # The bf16 gradient is the fp32 one rounded once: 1 bf16 ulp.
    torch.testing.assert_close(g.float(), gr.to(torch.bfloat16).float(), rtol=2**-8, atol=1e-9)


def test_cross_entropy_large_logits_finite():
    logits, target = _data(scale=1e4)
    ours = cross_entropy(logits, target)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(
        ours, F.cross_entropy(logits, target, reduction="none"), rtol=1e-6, atol=1e-3
    )


def test_cross_entropy_gradcheck_fp64():
    logits, target = _data(n=8, vocab=5)
    x = logits.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: cross_entropy(t, target), (x,))


def test_cross_entropy_validates():
    logits, target = _data()
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        cross_entropy(logits[None], target)
    with pytest.raises(ValueError, match="target"):
        cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="int64"):
        cross_entropy(logits, target.int())
