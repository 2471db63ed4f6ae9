"""Cross-entropy over vocab-sharded logits, without gathering the vocabulary.

Each tp rank holds ``logits [N, V/tp]`` for vocabulary rows
``[r V/tp, (r+1) V/tp)``. The loss needs three numbers per token that span the
whole vocabulary: the max logit (for a stable exp), the sum of exps and the
target's logit. Each rank computes them over its shard, in its own max's frame
(``m_r``, ``s_r = sum exp(x - m_r)``, its share of the target logit), and one
all-gather of ``[N, 3]`` over tp gives every rank all of them, from which it
combines ``M = max m_r`` and ``S = sum s_r exp(m_r - M)`` (the merge of a
blockwise softmax). One collective per call: Megatron-Core makes three (max, then
target logit, then sum), and the collectives of a small ``[N]`` are latency, not
bytes. The full ``[N, V]`` never exists, which matters at V = 128k: it would be the
largest activation of the model.

Backward is the softmax minus the one-hot target, both local to the shard:
``exp(x - m_r) * exp(m_r - M) / S``. It reuses the saved buffer of local exps in
place (Megatron keeps the softmax the same way: that buffer is the size of the
logits), scaling each row once by the loss gradient, so the graph supports one
backward; a second one, with ``retain_graph``, fails loudly on autograd's version
check instead of returning wrong numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.parallel.tensor.mappings import TPGroup
from mtcore.parallel.tensor.vocab_check import check_vocab_ids


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, tp: TPGroup, ignore_index: int):
        acc = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(acc)
        v_local = x.shape[1]
        start = tp.rank * v_local

        valid = target != ignore_index
        here = valid & (target >= start) & (target < start + v_local)
        local_target = torch.where(here, target - start, torch.zeros_like(target))
        target_logit = x.gather(1, local_target[:, None]).squeeze(1).masked_fill(~here, 0.0)

        local_max = torch.amax(x, dim=1)  # no argmax indices, unlike ``max``
        exp = torch.sub(x, local_max[:, None]).exp_()  # a new tensor: ``logits`` is untouched
        stats = torch.stack((local_max, exp.sum(dim=1), target_logit), dim=1)  # [N, 3]
        every = tp.all_gather(stats, dim=0).view(tp.size, -1, 3)  # the one collective
        maxes, sums, targets = every.unbind(2)
        logit_max = maxes.amax(dim=0)
        sum_exp = (sums * (maxes - logit_max).exp()).sum(dim=0)
        loss = (sum_exp.log() + logit_max - targets.sum(dim=0)).masked_fill(~valid, 0.0)
        # The local exps are kept, not the softmax: backward scales each row by
        # exp(m_r - M) / S in the one pass it makes anyway.
        row_scale = (local_max - logit_max).exp() / sum_exp
        ctx.save_for_backward(exp, row_scale, local_target, here, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        exp, row_scale, local_target, here, valid = ctx.saved_tensors
        scale = (grad_loss * valid).to(exp.dtype)
        grad = exp.mul_((scale * row_scale)[:, None])  # softmax * dloss, in place: one backward
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= scale * here.to(grad.dtype)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, tp: TPGroup, ignore_index: int = -100
) -> Tensor:
    """Per-token loss ``-log softmax(full logits)[n, target[n]]`` from a vocab shard.

    Args:
        logits: ``[N, V/tp]``, this rank's vocabulary slice (any float dtype;
            the softmax is float32).
        target: ``[N]`` int64 indices into the *full* vocabulary, or ``ignore_index``.
        tp: the tensor-parallel group (``TPGroup.from_layout(layout, backend)``).

    Returns:
        ``[N]`` float32 loss (float64 for float64 logits), equal on every tp
        rank; ignored positions have loss 0 and zero gradient. With one rank
        this is the backend's ``cross_entropy`` kernel.

    Raises IndexError for a target outside ``[0, V)`` other than ``ignore_index``:
    at tp > 1 no shard would own it, so its loss would be a silent ln V.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"need logits [N, V/tp] and target [N], got {list(logits.shape)}, {list(target.shape)}"
        )
    check_vocab_ids(target, logits.shape[1] * tp.size, "label", ignore_index)
    if tp.size == 1:
        return tp.backend.kernels.cross_entropy(logits, target, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, tp, ignore_index)


@torch.no_grad()
def vocab_parallel_argmax(logits: Tensor, tp: TPGroup) -> Tensor:
    """The full-vocabulary index of the largest logit, from this rank's shard ``[..., V/tp]``.

    For accuracy metrics over logits that are never gathered: an all-reduce(max) of the
    per-rank best values, then an all-reduce(min) of the indices that reach it, so a
    tie goes to the lowest index, as ``torch.argmax`` does. Equal on every tp rank.
    """
    local = logits.argmax(dim=-1)
    if tp.size == 1:
        return local
    best = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float()
    overall = best.clone()
    tp.collective.all_reduce(overall, op="max", group=tp.group)
    v_local = logits.shape[-1]
    index = local + tp.rank * v_local
    candidate = torch.where(best == overall, index, torch.full_like(index, v_local * tp.size))
    tp.collective.all_reduce(candidate, op="min", group=tp.group)
    return candidate
