"""grouped_mm against a per-expert torch.mm loop."""

import pytest
import torch

from mtcore.ops import grouped_mm


def _loop(x, w, counts):
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(torch.mm(x[start : start + c], w[e]))
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 10, 0, 0], [1, 1, 1, 1]])
def test_grouped_mm_fp32_forward_backward(counts):
    t, k, n = sum(counts), 6, 4
    x = torch.randn(t, k, requires_grad=True)
    w = torch.randn(len(counts), k, n, requires_grad=True)
    tpe = torch.tensor(counts, dtype=torch.int32)
    ours, ref = grouped_mm(x, w, tpe), _loop(x, w, counts)
    assert ours.shape == (t, n)
    # Same fp32 matmuls on the same blocks; allow reassociation inside the mm kernel.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn(t, n)
    gx, gw = torch.autograd.grad(ours, (x, w), gy)
    rx, rw = torch.autograd.grad(ref, (x, w), gy)
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-6, atol=1e-6)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(gw[e], torch.zeros_like(gw[e]))


def test_grouped_mm_bf16():
    counts = [4, 0, 9]
    x = torch.randn(13, 64).to(torch.bfloat16)
    w = torch.randn(3, 64, 32).to(torch.bfloat16)
    ours = grouped_mm(x, w, torch.tensor(counts))
    ref = _loop(x.float(), w.float(), counts).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    # fp32 accumulation then one rounding on both sides: <= 1 bf16 ulp.
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-8, atol=1e-5)


def test_grouped_mm_gradcheck_fp64():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True)
    tpe = torch.tensor([2, 0, 3])
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, tpe), (x, w))


def test_grouped_mm_validates():
    x, w = torch.randn(5, 3), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="sums to 4"):
        grouped_mm(x, w, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="3 experts"):
        grouped_mm(x, w, torch.tensor([2, 2, 1]))
    with pytest.raises(ValueError, match="non-negative"):
        grouped_mm(x, w, torch.tensor([6, -1]))
    with pytest.raises(ValueError, match="inner dims"):
        grouped_mm(torch.randn(5, 2), w, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="integer"):
        grouped_mm(x, w, torch.tensor([2.0, 3.0]))
