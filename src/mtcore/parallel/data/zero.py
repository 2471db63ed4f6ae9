"""The ZeRO stages as strategies of the gradient reducer (``DataParallel``).

The reducer (``ddp.py``) owns what every stage shares: the fp32 buckets, the hooks that
see gradients arrive, overlap with backward, the launch log and the wait. A stage says
what differs: how a buffer is laid out (padded to the group, holding only a shard), which
collective reduces a bucket, which part of it this rank owns, and (ZeRO-2, 3) what lives
between a bucket's reductions and around a block's use.

* ``Replicated`` (ZeRO-0, and 1-bit Adam's uncompressed steps): all-reduce, every rank
  holds every reduced gradient.
* ``ShardedOptimizer`` (ZeRO-1): reduce-scatter; each rank owns one shard of every bucket
  (the buffers padded to a multiple of the group), the optimizer steps that shard.
* ``ShardedGradients`` (ZeRO-2): the buffers keep only the owned shard. A bucket's whole
  fp32 gradient is allocated when its first gradient of a backward arrives and freed once
  its reduce-scatter has landed, so every micro-batch's backward reduces (``no_sync``
  does not apply: there is nowhere to accumulate a whole gradient). The rank adds the
  shard it already holds into its own input before the reduce-scatter, so the shard
  accumulates over micro-batches at no extra buffer. At most two buckets' whole
  gradients are alive at once (the one filling and the one in flight). Deferred buffers
  (tied halves split over stages) keep whole gradients: they are summed over stages
  after backward.
* ``ShardedParameters`` (ZeRO-3): ZeRO-2, and each unit's (transformer block's) params
  sharded too, gathered around its uses (``zero3.ShardedParams``).

Which stage a ``DataParallelConfig`` asks for, and which optimizer steps it, is the
strategy table's (``strategies.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from torch import nn

from mtcore.parallel.data.buffer import Bucket
from mtcore.parallel.data.zero3 import ShardedParams


class Replicated:
    """ZeRO-0: every bucket all-reduced, every reduced gradient on every rank."""

    stage = 0
    sharded_params: ShardedParams | None = None

    def pad_to(self, size: int) -> int:
        """What a buffer's length is padded to a multiple of (its reduction group's size)."""
        return 1

    def gradient_shard(self, rank: int, size: int, deferred: bool) -> tuple[int, int] | None:
        """(rank, size) when a buffer keeps only this rank's shard of its gradient."""
        return None

    def attach(self, ddp, units: Sequence[nn.Module]) -> None:
        """Called once the reducer's buckets exist."""

    def reduce(self, ddp, bucket: Bucket, group, size: int, rank: int):
        """Start ``bucket``'s reduction over ``group``; its handle, or None when done."""
        if size == 1:
            return None
        return ddp.collective.all_reduce(bucket.grad, op="sum", group=group, async_op=True)

    def reduces_every_microbatch(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` reduces from every backward, under ``no_sync`` too."""
        return False

    def before_grad(self, ddp, bucket: Bucket) -> None:
        """A gradient of ``bucket`` is about to be added into it."""

    def after_backward(self, bucket: Bucket) -> None:
        """Every param of ``bucket`` has its gradient of this backward."""

    def launches_at_finish(self, bucket: Bucket) -> bool:
        """Whether ``finish_grad_sync`` still has to reduce ``bucket`` (not in flight)."""
        return True

    def finish(self, ddp) -> None:
        """Every reduction has landed (``finish_grad_sync``)."""

    def zero_grad(self, ddp) -> None:
        """The buffers were zeroed for a new step."""

    def owned_range(self, bucket: Bucket, size: int, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of ``bucket`` whose reduced gradient this rank holds."""
        return bucket.start, bucket.end

    def gathered(self, write_back: bool) -> contextlib.AbstractContextManager:
        """Every param whole inside the ``with``."""
        return contextlib.nullcontext()


class ShardedOptimizer(Replicated):
    """ZeRO-1: every bucket reduce-scattered; this rank owns one shard of each."""

    stage = 1

    def pad_to(self, size: int) -> int:
        return size

    def reduce(self, ddp, bucket: Bucket, group, size: int, rank: int):
        if size == 1:
            return None
        lo, hi = bucket.shard(rank, size)
        shard = bucket.buffer.grad[lo:hi]
        return ddp.collective.reduce_scatter(
            shard, bucket.grad, op="sum", group=group, async_op=True
        )

    def owned_range(self, bucket: Bucket, size: int, rank: int) -> tuple[int, int]:
        return bucket.shard(rank, size)


class ShardedGradients(ShardedOptimizer):
    """ZeRO-2: the buffers keep only the owned shard of the reduced gradient."""

    stage = 2

    def __init__(self):
        self.in_flight: list[Bucket] = []  # buckets whose whole gradient is alive
        self.reduced: set[int] = set()  # buckets reduced at least once this step

    def gradient_shard(self, rank: int, size: int, deferred: bool) -> tuple[int, int] | None:
        return None if deferred else (rank, size)

    def reduce(self, ddp, bucket: Bucket, group, size: int, rank: int):
        if bucket.buffer.shard is None:  # a deferred buffer: whole, as under ZeRO-1
            return super().reduce(ddp, bucket, group, size, rank)
        # reduce-scatter the whole gradient into the owned shard, which keeps what earlier
        # micro-batches reduced (added into this rank's own input)
        self.reduced.add(bucket.index)
        lo, hi = bucket.shard(rank, size)
        shard = bucket.buffer.grad_range(lo, hi)
        whole = bucket.grad
        whole[lo - bucket.start : hi - bucket.start].add_(shard)
        for earlier in self.in_flight:  # bound the live whole gradients to two
            self._settle(ddp, earlier)
        self.in_flight.append(bucket)
        if size == 1:
            shard.copy_(whole)
            return None
        return ddp.collective.reduce_scatter(shard, whole, op="sum", group=group, async_op=True)

    def _settle(self, ddp, bucket: Bucket) -> None:
        """Wait for ``bucket``'s reduction and free its whole gradient."""
        ddp.wait_for(bucket.index)
        bucket.buffer.close_bucket(bucket)
        if bucket in self.in_flight:
            self.in_flight.remove(bucket)

    def reduces_every_microbatch(self, bucket: Bucket) -> bool:
        return bucket.buffer.shard is not None

    def before_grad(self, ddp, bucket: Bucket) -> None:
        if bucket.buffer.shard is not None:
            if ddp.in_flight(bucket):  # an earlier micro-batch's reduction
                self._settle(ddp, bucket)
            bucket.buffer.open_bucket(bucket)

    def launches_at_finish(self, bucket: Bucket) -> bool:
        if bucket.buffer.shard is None or bucket.full_grad is not None:
            return True
        if bucket.index in self.reduced:  # nothing arrived since its reduction
            return False
        bucket.buffer.open_bucket(bucket)  # no gradient this step: reduce zeros
        return True

    def finish(self, ddp) -> None:
        for bucket in list(self.in_flight):
            self._settle(ddp, bucket)
        self.reduced.clear()

    def zero_grad(self, ddp) -> None:
        for buf in ddp.grad_buffers:
            if buf.shard is not None:
                for bucket in buf.buckets:
                    buf.close_bucket(bucket)
        self.in_flight.clear()
        self.reduced.clear()


class ShardedParameters(ShardedGradients):
    """ZeRO-3: ZeRO-2, and the units' params sharded, gathered a unit at a time."""

    stage = 3

    def attach(self, ddp, units: Sequence[nn.Module]) -> None:
        self.sharded_params = ShardedParams(ddp, units)

    def after_backward(self, bucket: Bucket) -> None:
        if bucket.buffer.shard_params:  # its backward is done: the whole params go
            self.sharded_params.release(bucket)

    def finish(self, ddp) -> None:
        super().finish(ddp)
        self.sharded_params.release_all()

    def gathered(self, write_back: bool) -> contextlib.AbstractContextManager:
        return self.sharded_params.gathered(write_back)
