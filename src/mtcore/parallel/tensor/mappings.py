"""Autograd-aware communication over the tensor-parallel group.

Activation layout (the convention every TP/SP module and the GPT model follow):
``[batch, seq, hidden]``, batch first (torchtitan style), so the sequence dim
is 1 and tensor-parallel shards split the last dim. Batch-first matches the
kernel ops (``rope`` takes ``[b, s, heads, d]``) and the token layout
``[b, s]`` of the data. The price: the collectives concatenate along dim 0,
so a gather / reduce-scatter on the sequence dim costs one extra local copy of
the full activation (none when ``batch == 1``): 0.08 ms for ``[4, 256, 512]``
fp32 on one CPU core, under 0.5% of a sequence-parallel block step
(docs/results/tensor_parallel.md). Megatron's ``[s, b, h]`` avoids that copy
but needs transposes to feed batch-first kernels.

Each function is a pair of (forward, backward) collectives that are adjoint to
each other, as in Megatron-Core:

========================  =======================  =========================
function                  forward                  backward
========================  =======================  =========================
copy_to_tp                identity                 all-reduce
reduce_from_tp            all-reduce               identity
scatter_to_tp             split last dim           all-gather last dim
gather_from_tp            all-gather last dim      split last dim
scatter_to_sp             split seq dim            all-gather seq dim
gather_from_sp            all-gather seq dim       reduce-scatter seq dim
reduce_scatter_to_sp      reduce-scatter seq dim   all-gather seq dim
========================  =======================  =========================

All of them return their input unchanged when the group has one rank, so a
model written with them runs in one process with no collective at all.
``ColumnParallelLinear`` does not call ``copy_to_tp`` / ``gather_from_sp``: it
fuses them with its matmul to overlap the backward collective (``linear``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mtcore.parallel.layout import Axis

SEQ_DIM = 1


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as the layers see it.

    backend: the ``mtcore.backend.Backend`` (collectives and kernels go through it).
    group: the torch ProcessGroup of the tp ranks (None when ``size == 1``).
    size, rank: tp world size and this rank's index in it.
    """

    backend: object
    group: object
    size: int
    rank: int

    @classmethod
    def from_layout(cls, layout, backend) -> TPGroup:
        """The tp group of a ``ParallelLayout``."""
        return cls(backend, layout.group(Axis.TP), layout.tp, layout.tp_rank)

    @classmethod
    def single(cls, backend) -> TPGroup:
        """No tensor parallelism: every mapping is the identity."""
        return cls(backend, None, 1, 0)

    @property
    def collective(self):
        return self.backend.collective

    def __deepcopy__(self, memo):
        return self  # a handle on process groups: copies of a model share it

    def all_reduce(self, x: Tensor, op: str = "sum", inplace: bool = False) -> Tensor:
        """Sum (or ``op``) over the group. Out of place unless ``inplace``: a
        tensor in the autograd graph may be aliased (the same grad flows into
        both branches of a residual add), so only fresh buffers are reduced in place."""
        out = x if inplace and x.is_contiguous() else x.contiguous().clone()
        self.collective.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """Concatenate every rank's ``x`` along ``dim``."""
        return self.all_gather_async(x, dim)()

    def all_gather_async(self, x: Tensor, dim: int) -> Callable[[], Tensor]:
        """Start the all-gather; the returned function waits and gives the result."""
        dim = dim % x.dim()
        x = x.contiguous()
        out = x.new_empty((self.size, *x.shape))  # the collective stacks on dim 0
        handle = self.collective.all_gather(out.flatten(0, 1), x, group=self.group, async_op=True)
        shape = list(x.shape)
        shape[dim] *= self.size

        def finish() -> Tensor:
            handle.wait()
            # [tp, ..., d_local, ...] -> [..., tp * d_local, ...]; a copy unless dim == 0
            return out.movedim(0, dim).reshape(shape)

        return finish

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        """Sum over ranks, keep this rank's 1/size slice of ``dim``."""
        return self.reduce_scatter_async(x, dim)()

    def reduce_scatter_async(self, x: Tensor, dim: int) -> Callable[[], Tensor]:
        """Start the reduce-scatter; the returned function waits and gives the result."""
        dim = dim % x.dim()
        if x.shape[dim] % self.size:
            raise ValueError(
                f"dim {dim} of shape {list(x.shape)} is not divisible by tp={self.size}"
            )
        local = x.shape[dim] // self.size
        split = x.unflatten(dim, (self.size, local)).movedim(dim, 0).contiguous()
        out = x.new_empty(split.shape[1:])
        handle = self.collective.reduce_scatter(
            out, split.flatten(0, 1), group=self.group, async_op=True
        )

        def finish() -> Tensor:
            handle.wait()
            return out

        return finish

    def split(self, x: Tensor, dim: int) -> Tensor:
        """This rank's slice of ``dim`` (a copy, so the full tensor can be freed)."""
        if x.shape[dim] % self.size:
            raise ValueError(
                f"dim {dim} of shape {list(x.shape)} is not divisible by tp={self.size}"
            )
        return x.chunk(self.size, dim)[self.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, inplace):
        inplace = inplace and x.is_contiguous()
        if inplace:
            ctx.mark_dirty(x)
        return tp.all_reduce(x, inplace=inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.split(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim, reduce_grad):
        ctx.tp, ctx.dim, ctx.reduce_grad = tp, dim, reduce_grad
        return tp.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return ctx.tp.reduce_scatter(grad, ctx.dim), None, None, None
        return ctx.tp.split(grad, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, ctx.dim), None, None


def copy_to_tp(x: Tensor, tp: TPGroup) -> Tensor:
    """Enter a tp region with a replicated ``x``: each rank's grad is partial, so sum it."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: Tensor, tp: TPGroup, inplace: bool = False) -> Tensor:
    """Leave a tp region: ``x`` is a partial sum on each rank; the result is replicated.

    inplace: reduce ``x``'s own buffer (no copy). Only for a tensor that nothing
      else reads, such as the fresh output of a matmul.
    """
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp, inplace)


def scatter_to_tp(x: Tensor, tp: TPGroup) -> Tensor:
    """``[..., h]`` replicated -> ``[..., h / tp]``, this rank's slice of the last dim."""
    return x if tp.size == 1 else _Split.apply(x, tp, -1)


def gather_from_tp(x: Tensor, tp: TPGroup) -> Tensor:
    """``[..., h / tp]`` -> ``[..., h]`` replicated (the backward keeps this rank's slice)."""
    return x if tp.size == 1 else _Gather.apply(x, tp, x.dim() - 1, False)


def scatter_to_sp(x: Tensor, tp: TPGroup) -> Tensor:
    """``[b, s, h]`` replicated -> ``[b, s / tp, h]``, this rank's sequence shard."""
    return x if tp.size == 1 else _Split.apply(x, tp, SEQ_DIM)


def gather_from_sp(x: Tensor, tp: TPGroup, reduce_grad: bool = True) -> Tensor:
    """``[b, s / tp, h]`` -> ``[b, s, h]`` (all-gather on the sequence dim).

    reduce_grad: True when the gathered tensor feeds a tp region (each rank's
      grad is then a partial sum: the backward reduce-scatters). False when it
      feeds a computation replicated on every rank (each rank already holds
      the full grad: the backward only keeps this rank's shard).
    """
    return x if tp.size == 1 else _Gather.apply(x, tp, SEQ_DIM, reduce_grad)


def gather_rows(x: Tensor, group: TPGroup) -> Tensor:
    """``[n, ...]`` per rank -> ``[size * n, ...]`` on every rank; each rank's grad is a
    partial sum, so the backward reduce-scatters (MoE's all-gather dispatch)."""
    return x if group.size == 1 else _Gather.apply(x, group, 0, True)


def reduce_scatter_rows(x: Tensor, group: TPGroup) -> Tensor:
    """``[size * n, ...]`` partial sums -> ``[n, ...]`` summed, this rank's rows."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, 0)


def reduce_scatter_to_sp(x: Tensor, tp: TPGroup) -> Tensor:
    """``[b, s, h]`` partial sums -> ``[b, s / tp, h]`` summed over tp, this rank's shard."""
    return x if tp.size == 1 else _ReduceScatter.apply(x, tp, SEQ_DIM)
