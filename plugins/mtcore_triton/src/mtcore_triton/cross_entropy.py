"""Token-level cross entropy in Triton, without materialising the softmax.

The forward streams each row of logits once with an online log-sum-exp (running
max and rescaled sum, float32) and saves only ``lse`` per row. The backward
streams the row again and writes ``(exp(x - lse) - onehot) * dloss`` directly
as the logits gradient: the softmax never exists as a tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtcore.ops.loss import check_cross_entropy_args
from mtcore_triton.launch import DEFAULT_THREADS, num_warps
from mtcore_triton.rounding import store_rounded

BLOCK_V = 1024  # vocabulary chunk per step: 8 logits per thread of DEFAULT_THREADS


@triton.jit
def _ce_fwd(logits_ptr, target_ptr, loss_ptr, lse_ptr, v, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * v
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that saw only padding keep m = -inf; shift them by 0, not by -inf (nan).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    mx = tl.max(m, axis=0)  # finite: every row has at least one logit
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    tl.store(lse_ptr + row, lse)
    t = tl.load(target_ptr + row)
    valid = t != ignore_index
    safe = tl.where(valid, t, 0)
    x_t = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))


@triton.jit
def _ce_bwd(
    logits_ptr, target_ptr, lse_ptr, dloss_ptr, dlogits_ptr, v, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row)
    valid = t != ignore_index
    scale = tl.where(valid, tl.load(dloss_ptr + row).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < v
        x = tl.load(logits_ptr + row * v + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
        store_rounded(dlogits_ptr + row * v + cols, grad, mask)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        logits = logits.contiguous()
        n, v = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n:
            _ce_fwd[(n,)](
                logits,
                target,
                loss,
                lse,
                v,
                ignore_index,
                BLOCK=min(BLOCK_V, triton.next_power_of_2(v)),
                num_warps=num_warps(DEFAULT_THREADS),
            )
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        dlogits = torch.empty_like(logits)
        if n:
            _ce_bwd[(n,)](
                logits,
                target,
                lse,
                dloss.contiguous(),
                dlogits,
                v,
                ctx.ignore_index,
                BLOCK=min(BLOCK_V, triton.next_power_of_2(v)),
                num_warps=num_warps(DEFAULT_THREADS),
            )
        return dlogits, None, None


def cross_entropy(logits, target, ignore_index=-100):
    """``mtcore.ops.cross_entropy`` in Triton: per-token float32 losses, 0 where ignored.

    Targets outside ``[0, V)`` other than ``ignore_index`` are not checked on the
    device (that would synchronise); the reference raises for them.
    """
    check_cross_entropy_args(logits, target)
    return _CrossEntropy.apply(logits, target.contiguous(), ignore_index)
