"""Contiguous parameter and gradient storage, cut into buckets.

Megatron-Core's layout: the params of one dtype live in one flat tensor (each
``Parameter`` becomes a view into it), and their gradients in one flat fp32
"main grad" tensor with the same layout. Buckets are consecutive ranges of
both. Params are assigned to buckets in *reverse* registration order, because
backward produces gradients roughly from the last layer to the first: bucket 0
fills first and its reduction can start while backward is still running.

Each bucket is padded to a multiple of ``pad_to`` (the data-parallel size when
the optimizer is sharded), so it splits into equal contiguous shards.

With ``shard`` (ZeRO-2) the buffer keeps no whole fp32 gradient: ``grad`` holds
only this rank's shard of every bucket, back to back, and a bucket's whole
gradient (``Bucket.full_grad``) exists only from its first gradient of a backward
until its reduce-scatter has landed in the shard (``DataParallel`` allocates and
frees it). ``grad_range`` maps buffer coordinates to either storage.

With ``shard_params`` too (ZeRO-3) ``param_data`` likewise holds only this rank's
shard of every bucket, and the buckets are given (``groups``: one per layer) rather
than cut by size. Each bucket's params are views of its own whole tensor
``Bucket.full_params``, whose storage is empty at rest: ``materialize`` gives it its
bytes back (a gather fills them), ``release`` frees them. The views, and the views
autograd saved of them in forward, stay valid through both: only the storage's size
changes, never a param's ``.data`` (so no version counter moves).

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

from mtcore.parallel.layout import Axis


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
        return self.buffer.grad_range(self.start, self.end)

    @property
    def param_data(self) -> Tensor:
        return self.buffer.param_range(self.start, self.end)


@dataclass
class Bucket(BufferRange):
    """A bucket of one ``GradBuffer``; ``end`` includes the padding."""

    index: int = 0
    params: list[Parameter] = field(default_factory=list)
    full_grad: Tensor | None = None  # ZeRO-2: the bucket's whole gradient while it lives
    full_params: Tensor | None = None  # ZeRO-3: the whole params' storage (empty at rest)

    @property
    def grad(self) -> Tensor:
        """The bucket's whole gradient (under ZeRO-2 the transient ``full_grad``)."""
        if self.buffer.shard is None:
            return self.buffer.grad[self.start : self.end]
        if self.full_grad is None:
            raise RuntimeError(f"bucket {self.index} holds no whole gradient now (ZeRO-2)")
        return self.full_grad

    @property
    def param_data(self) -> Tensor:
        """The bucket's whole params (under ZeRO-3 ``full_params``, whole while gathered)."""
        if self.full_params is None:
            return self.buffer.param_data[self.start : self.end]
        return self.full_params

    @property
    def materialized(self) -> bool:
        """Whether the bucket's whole params have storage (always, but under ZeRO-3)."""
        return self.full_params is None or self.full_params.untyped_storage().nbytes() > 0

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
    shard: ``(rank, size)`` in that group to keep only this rank's gradient shard
    (ZeRO-2); then ``main_grad`` exists only while its bucket's ``full_grad`` does.
    groups: the buckets' params, in registration order (default: cut by ``bucket_size``).
    shard_params: keep only this rank's shard of the params too (ZeRO-3, needs ``shard``).
    """

    def __init__(
        self,
        params: Sequence[Parameter],
        bucket_size: int,
        pad_to: int = 1,
        first_bucket_index: int = 0,
        grad_dtype: torch.dtype = torch.float32,
        reduce_group: Axis = Axis.DP_CP,
        shard: tuple[int, int] | None = None,
        groups: Sequence[Sequence[Parameter]] | None = None,
        shard_params: bool = False,
    ):
        if shard_params and shard is None:
            raise ValueError("shard_params (ZeRO-3) needs shard (ZeRO-2's gradient shards)")
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
        if groups is None:
            groups = _split(list(reversed(self.params)), bucket_size)
        else:
            groups = [list(reversed(g)) for g in reversed(groups)]
        for group in groups:
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
        self.shard = shard
        self.grad_dtype = grad_dtype

        self.shard_params = shard_params
        # ZeRO-2: where each bucket's owned shard starts, in buffer and in ``grad``.
        self._shard_starts: list[tuple[int, int, int]] = []  # (lo, hi, offset in grad)
        if shard is None:
            self.grad = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        else:
            offset = 0
            for bucket in self.buckets:
                lo, hi = bucket.shard(*shard)
                self._shard_starts.append((lo, hi, offset))
                offset += hi - lo
            self.grad = torch.zeros(offset, dtype=grad_dtype, device=self.device)
        # ZeRO-3: only the shards, back to back like ``grad``; each bucket's whole params
        # get storage of their own (to be freed and given back), one bucket at a time
        # here, so building the buffer holds little more than the model.
        numel = self.grad.numel() if shard_params else self.numel
        self.param_data = torch.zeros(numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for bucket in self.buckets:
                if shard_params:
                    bucket.full_params = self.param_data.new_zeros(bucket.numel)
                for p in bucket.params:
                    start, end = self.ranges[id(p)]
                    view = bucket.param_data[start - bucket.start : end - bucket.start].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    if shard is None:
                        p.main_grad = self.grad[start:end].view_as(p)
                if shard_params:
                    lo, hi = (i - bucket.start for i in bucket.shard(*shard))
                    self.owned_params(bucket).copy_(bucket.full_params[lo:hi])
                    self.release(bucket)

    def grad_range(self, start: int, end: int) -> Tensor:
        """The fp32 gradient of buffer range ``[start, end)``; under ZeRO-2 the range
        must lie in one bucket's owned shard (an optimizer segment always does)."""
        if self.shard is None:
            return self.grad[start:end]
        return self.grad[self._owned_slice(start, end)]

    def param_range(self, start: int, end: int) -> Tensor:
        """The params of buffer range ``[start, end)``; under ZeRO-3 the range must lie in
        one bucket's owned shard, as for ``grad_range``."""
        if not self.shard_params:
            return self.param_data[start:end]
        return self.param_data[self._owned_slice(start, end)]

    def _owned_slice(self, start: int, end: int) -> slice:
        for lo, hi, offset in self._shard_starts:
            if lo <= start and end <= hi:
                return slice(offset + start - lo, offset + end - lo)
        raise ValueError(f"range [{start}, {end}) is not inside one owned shard")

    def materialize(self, bucket: Bucket) -> Tensor:
        """ZeRO-3: give ``bucket``'s whole params their storage back (contents undefined
        until a gather fills them); returns ``full_params``."""
        storage = bucket.full_params.untyped_storage()
        storage.resize_(bucket.numel * bucket.full_params.element_size())
        return bucket.full_params

    def release(self, bucket: Bucket) -> None:
        """ZeRO-3: free ``bucket``'s whole params (the shard in ``param_data`` stays)."""
        bucket.full_params.untyped_storage().resize_(0)

    def owned_params(self, bucket: Bucket) -> Tensor:
        """This rank's shard of ``bucket``'s params (ZeRO-3), a view of ``param_data``."""
        return self.param_range(*bucket.shard(*self.shard))

    def open_bucket(self, bucket: Bucket) -> Tensor:
        """ZeRO-2: give ``bucket`` a zeroed whole gradient and point its params'
        ``main_grad`` into it (a no-op while it has one)."""
        if bucket.full_grad is None:
            bucket.full_grad = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device)
            for p in bucket.params:
                start, end = self.ranges[id(p)]
                p.main_grad = bucket.full_grad[start - bucket.start : end - bucket.start].view_as(p)
        return bucket.full_grad

    def close_bucket(self, bucket: Bucket) -> None:
        """ZeRO-2: drop ``bucket``'s whole gradient (its reduction has landed)."""
        bucket.full_grad = None
        for p in bucket.params:
            p.__dict__.pop("main_grad", None)

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
