"""The column-parallel matmul with its input-gradient collective overlapped (or not).

``y = gather_sp(x) @ W^T + b`` as one autograd function, so that backward can
run the collective on the input gradient while it computes the weight
gradient (Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``):

    without sequence parallel          with sequence parallel
    dx = dy @ W                        start all-gather of the saved x shard
    start all-reduce(dx)               dx = dy @ W
    dW = dy^T @ x                      x_full = wait(all-gather)
    wait                               start reduce-scatter(dx)
                                       dW = dy^T @ x_full
                                       wait

Under sequence parallel only the local shard ``[b, s/tp, h]`` of the input is
kept for backward and re-gathered there (the gather hides behind ``dy @ W``):
keeping the gathered ``[b, s, h]`` would give back most of the activation
memory that sequence parallel saves. The collectives are async calls of the
backend's collective interface, so this overlaps on any backend that runs
them concurrently with compute (NCCL/MCCL streams, gloo's worker threads).
``MTCORE_TP_OVERLAP=0`` (``overlaps_backward_collectives``) takes the blocking order
instead, each collective to completion before the next matmul: the same numbers,
for a host whose ranks have no core to spare for the collective's thread.

Inside ``weight_grad.deferring_weight_grads`` (the B/W split of a zero-bubble
schedule) backward computes only ``dx`` and its collective; ``dW`` is left to the
W pass, which re-gathers the saved shard under sequence parallel.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from mtcore.parallel.tensor.mappings import SEQ_DIM, TPGroup
from mtcore.parallel.tensor.weight_grad import active_store, linear, weight_grad

OVERLAP_ENV = "MTCORE_TP_OVERLAP"


def overlaps_backward_collectives() -> bool:
    """Whether backward runs the input-gradient collective concurrently with the
    weight-gradient matmul: yes unless ``MTCORE_TP_OVERLAP=0``.

    The blocking order (the collective to completion, then the matmul) is there to
    measure, and for a host where a rank has no core to spare: on CPU the gloo
    worker thread that runs the collective shares the rank's core with the matmul.
    Measured on 2 shared cores (docs/results/megatron.md), overlap was not slower than
    blocking, under load too, so it stays the default on every backend.
    """
    choice = os.environ.get(OVERLAP_ENV, "").strip()
    if choice in ("", "1"):
        return True
    if choice == "0":
        return False
    raise ValueError(f"{OVERLAP_ENV} must be 0 or 1 (unset: 1, overlap), got {choice!r}")


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp: TPGroup, sequence_parallel: bool):
        total = tp.all_gather(x, SEQ_DIM) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.sp, ctx.has_bias = tp, sequence_parallel, bias is not None
        ctx.overlap = overlaps_backward_collectives()
        ctx.store = active_store() if weight.requires_grad else None
        ctx.param = weight if ctx.store is not None else None  # not an alias (recompute)
        return torch.nn.functional.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        tp, sp = ctx.tp, ctx.sp
        grad = grad.contiguous()
        if ctx.store is not None:
            return _ColumnParallelMatmul._input_grads(ctx, grad, x, weight)
        gather = tp.all_gather_async(x, SEQ_DIM) if sp else None
        if gather is not None and not ctx.overlap:
            gathered = gather()
            gather = lambda: gathered  # noqa: E731
        grad_x = finish = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)  # [b, s, in], a partial sum over tp
        total = gather() if sp else x
        if grad_x is not None:
            if sp:
                finish = tp.reduce_scatter_async(grad_x, SEQ_DIM)
            else:
                handle = tp.collective.all_reduce(grad_x, group=tp.group, async_op=True)
                finish = lambda: (handle.wait(), grad_x)[1]  # noqa: E731
            if not ctx.overlap:  # blocking: the collective does not share the core
                grad_x, finish = finish(), None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad, total)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.flatten(0, -2).sum(0)
        if finish is not None:
            grad_x = finish()
        return grad_x, grad_w, grad_b, None, None

    @staticmethod
    def _input_grads(ctx, grad: Tensor, x: Tensor, weight: Tensor):
        """B of the B/W split: ``dx`` and its collective now, ``dW`` to the store."""
        tp, sp = ctx.tp, ctx.sp
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
            if sp:
                grad_x = tp.reduce_scatter_async(grad_x, SEQ_DIM)()
            else:
                tp.collective.all_reduce(grad_x, group=tp.group)
        ctx.store.defer(
            ctx.param, lambda: weight_grad(grad, tp.all_gather(x, SEQ_DIM) if sp else x)
        )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.flatten(0, -2).sum(0)
        return grad_x, None, grad_b, None, None


def column_parallel_matmul(
    x: Tensor, weight: Tensor, bias: Tensor | None, tp: TPGroup, sequence_parallel: bool
) -> Tensor:
    """``x [b, s(/tp), in]`` -> ``[b, s, out/tp]`` with ``weight [out/tp, in]``.

    With one rank it is ``F.linear`` (``weight_grad.linear``): no collective.
    """
    if tp.size == 1:
        return linear(x, weight, bias)
    return _ColumnParallelMatmul.apply(x, weight, bias, tp, sequence_parallel)
