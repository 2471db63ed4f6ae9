"""Contiguous parameter and gradient storage, cut into buckets.

Megatron-Core's layout: the params of one dtype live in one flat tensor (each
``Parameter`` becomes a view into it), and their gradients in one flat fp32
"main grad" tensor with the same layout. Buckets are consecutive ranges of
both. Params are assigned to buckets in *reverse* registration order, because
backward produces gradients roughly from the last layer to the first: bucket 0
fills first and its reduction can start while backward is still running.

Each bucket is padded to a multiple of ``pad_to`` (the data-parallel size when
the optimizer is sharded), so it splits into equal contiguous shards.

A buffer is reduced over one group, named by ``reduce_group``: ``dp_cp`` for
ordinary params, ``edp`` (expert data parallel) for mixture-of-experts expert
params, which differ across the expert-parallel ranks and so are replicated
only over the ranks that hold the same experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import Parameter

from mtcore.distributed import Axis


@dataclass
class BufferRange:
    """A range ``[start, end)`` of one ``GradBuffer``, with views of its params and grads."""

    buffer: GradBuffer
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def grad(self) -> Tensor:
        return self.buffer.grad[self.start : self.end]

    @property
    def param_data(self) -> Tensor:
        return self.buffer.param_data[self.start : self.end]


@dataclass
class Bucket(BufferRange):
    """A bucket of one ``GradBuffer``; ``end`` includes the padding."""

    index: int = 0
    params: list[Parameter] = field(default_factory=list)

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """Buffer coordinates of the contiguous shard that ``rank`` of ``size`` owns."""
        if self.numel % size:
            raise ValueError(
                f"bucket {self.index} ({self.numel} elements) does not split {size} ways"
            )
        n = self.numel // size
        return self.start + rank * n, self.start + (rank + 1) * n


class GradBuffer:
    """Flat storage for the params of one dtype: ``param_data`` and fp32 ``grad``.

    After construction every param's ``.data`` is a view of ``param_data`` and
    ``param.main_grad`` a view of ``grad`` (zeroed). ``ranges[id(param)]`` gives
    a param's ``(start, end)``. ``reduce_group``: the layout group whose ranks
    hold replicas of these params (the group the gradients are reduced over).
    """

    def __init__(
        self,
        params: Sequence[Parameter],
        bucket_size: int,
        pad_to: int = 1,
        first_bucket_index: int = 0,
        grad_dtype: torch.dtype = torch.float32,
        reduce_group: Axis = Axis.DP_CP,
    ):
        if not params:
            raise ValueError("a GradBuffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"one GradBuffer holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = params[0].dtype
        self.reduce_group = reduce_group
        # Set by DataParallel: the model chunk the params belong to, and whether
        # backward leaves the buffer's reduction to finish_grad_sync (tied halves).
        self.chunk = 0
        self.deferred = False
        self.device = params[0].device
        self.params = list(params)
        self.ranges: dict[int, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []

        offset = 0
        for group in _split(list(reversed(self.params)), bucket_size):
            # Within a bucket the order is free (the bucket is ready when all of
            # it is): matrices first, then vectors, so params that usually share
            # optimizer hyper-parameters (weight decay) are contiguous.
            group = sorted(group, key=lambda p: p.dim() < 2)
            bucket = Bucket(self, offset, offset, first_bucket_index + len(self.buckets), group)
            for p in group:
                self.ranges[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
            offset = -(-offset // pad_to) * pad_to
            bucket.end = offset
            self.buckets.append(bucket)
        self.numel = offset

        self.param_data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        with torch.no_grad():
            for p in self.params:
                start, end = self.ranges[id(p)]
                view = self.param_data[start:end].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grad[start:end].view_as(p)

    def range_of(self, param: Parameter) -> tuple[int, int]:
        return self.ranges[id(param)]


def _split(params: list[Parameter], bucket_size: int) -> list[list[Parameter]]:
    """Consecutive groups, each closed once it reaches ``bucket_size`` elements."""
    groups, current, count = [], [], 0
    for p in params:
        current.append(p)
        count += p.numel()
        if count >= bucket_size:
            groups.append(current)
            current, count = [], 0
    if current:
        groups.append(current)
    return groups
