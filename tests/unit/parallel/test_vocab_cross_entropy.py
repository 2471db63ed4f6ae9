"""The vocab-parallel cross-entropy's own maths, in one process.

A stand-in collective whose reductions and gathers are the identity runs the custom
forward/backward at one rank, so comparisons with torch (float64 to 1e-12, float32,
bfloat16) cover the code the distributed test runs over two ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.parallel.tensor import TPGroup, vocab_parallel_cross_entropy
from mtcore.parallel.tensor.cross_entropy import _VocabParallelCrossEntropy


class _OneRankCollective:
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return None

    def all_gather(self, output, input, group=None, async_op=False):
        output.copy_(input.reshape(output.shape))
        return SimpleNamespace(wait=lambda: None) if async_op else None


ONE_RANK = TPGroup(SimpleNamespace(collective=_OneRankCollective()), None, 1, 0)


def _data(dtype, n=12, v=10):
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(n, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = -100
    return logits, target


def test_custom_function_matches_torch_forward_and_backward():
    logits, target = _data(torch.float32)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    w = torch.randn(len(target))
    loss = _VocabParallelCrossEntropy.apply(a, target, ONE_RANK, -100)
    ref = F.cross_entropy(b, target, ignore_index=-100, reduction="none")
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert (loss[target == -100] == 0).all() and (a.grad[target == -100] == 0).all()


def test_custom_function_is_exact_in_float64():
    logits, target = _data(torch.float64)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    w = torch.randn(len(target), dtype=torch.float64)
    (_VocabParallelCrossEntropy.apply(a, target, ONE_RANK, -100) * w).sum().backward()
    (F.cross_entropy(b, target, reduction="none") * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


def test_backward_reuses_the_softmax_buffer_so_a_second_backward_is_refused():
    logits, target = _data(torch.float32)
    logits.requires_grad_(True)
    loss = _VocabParallelCrossEntropy.apply(logits, target, ONE_RANK, -100).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_low_precision_logits_give_float32_loss_and_same_dtype_grad():
    logits, target = _data(torch.bfloat16)
    logits.requires_grad_(True)
    loss = _VocabParallelCrossEntropy.apply(logits, target, ONE_RANK, -100)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.detach().float(), target, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


def test_one_rank_uses_the_backend_kernel():
    tp = TPGroup.single(select_backend("cpu"))
    logits, target = _data(torch.float32)
    ref = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target, tp), ref)
    with pytest.raises(ValueError, match="logits"):
        vocab_parallel_cross_entropy(logits[0], target, tp)
