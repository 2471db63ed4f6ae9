"""ZeRO-3: parameters sharded over data parallel, gathered one layer at a time.

Each *unit* (a transformer block: the modules ``DataParallel`` is given as ``units``)
owns whole buckets of ZeRO-3 buffers (one per buffer: its dense params and, in a
mixture-of-experts block, its expert params), and between uses each bucket holds
only this rank's shard of its params (``GradBuffer(shard_params=True)``). Around the
unit's uses:

* forward: a forward pre-hook all-gathers the unit's buckets (waiting for the gather
  started earlier, if any) and starts the next unit's gather (prefetch); the forward
  hook frees them again and hooks the outputs' gradients;
* backward: the first gradient of one of the unit's outputs gathers them again and
  starts the previous unit's gather (or, while the next unit's weight gradients are
  still coming, leaves that to the moment they are in); once every param of a bucket
  has its gradient (``DataParallel`` reduce-scatters it then, as under ZeRO-2) the
  bucket is freed;
* a recompute (activation checkpointing) runs the unit's forward inside its backward:
  the unit is then marked in backward and its forward hook leaves the params gathered.

Params outside the units (embeddings, the output layer, final norms, a vision tower)
stay whole: ZeRO-2's gradient shards and ZeRO-1's optimizer shards, all-gathered after
the step. A tied embedding is read by two modules, so no unit can own it.
``gathered`` materializes every unit for code that reads whole weights outside
forward and backward (checkpoints, weight export).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from mtcore.backend import tracing
from mtcore.parallel.data.buffer import Bucket


class ShardedParams:
    """The gather and free of the ZeRO-3 buckets of ``ddp`` around ``units``' uses.

    units: modules in forward order; each unit's trainable params must fill whole
    buckets of sharded-param buffers (``DataParallel`` builds them so). The next unit of
    the same model chunk (the previous in backward) is gathered while one computes.
    """

    def __init__(self, ddp, units: Sequence[nn.Module]):
        self.ddp = ddp
        self.units: list[list[Bucket]] = []
        self._unit_of: dict[int, int] = {}  # bucket index -> unit
        for u, module in enumerate(units):
            buckets = list({id(b): b for b in map(ddp.bucket_of, _trainable(module))}.values())
            self.units.append(buckets)
            for bucket in buckets:
                if not bucket.buffer.shard_params or set(map(id, bucket.params)) - set(
                    map(id, _trainable(module))
                ):
                    raise ValueError(f"unit {u} ({type(module).__name__}) does not own bucket "
                                     f"{bucket.index} as a ZeRO-3 bucket of its own")  # fmt: skip
                self._unit_of[bucket.index] = u
        self._chunk = [buckets[0].buffer.chunk if buckets else -1 for buckets in self.units]
        self._handles: dict[int, object] = {}  # bucket index -> gather in flight
        self._in_backward: set[int] = set()
        self._hooks = []
        for u, module in enumerate(units):
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre, u)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post, u)))

    # -- gathering ----------------------------------------------------------------------
    def _gather(self, bucket: Bucket) -> None:
        """Start ``bucket``'s all-gather into its whole params (a no-op while it has them)."""
        if bucket.materialized:
            return
        buf = bucket.buffer
        full = buf.materialize(bucket)
        group, size, _ = self.ddp.reduction_of(bucket)
        shard = buf.owned_params(bucket)
        if size == 1:
            full.copy_(shard)
            return
        self._handles[bucket.index] = self.ddp.collective.all_gather(
            full, shard, group=group, async_op=True
        )

    def _wait(self, bucket: Bucket) -> None:
        handle = self._handles.pop(bucket.index, None)
        if handle is not None:
            with tracing.phase("zero3 gather", "comm", bucket=bucket.index):
                handle.wait()

    def _near(self, u: int, v: int) -> bool:
        """Whether unit ``v`` exists and sits in unit ``u``'s model chunk."""
        return 0 <= v < len(self.units) and self._chunk[v] == self._chunk[u]

    def _prefetch(self, u: int, v: int) -> None:
        if self._near(u, v):
            for bucket in self.units[v]:
                self._gather(bucket)

    def _gather_unit(self, u: int, neighbour: int | None) -> None:
        """Gather unit ``u`` and wait for it; start unit ``neighbour``'s gather meanwhile."""
        for bucket in self.units[u]:
            self._gather(bucket)
        if neighbour is not None:
            self._prefetch(u, neighbour)
        for bucket in self.units[u]:
            self._wait(bucket)

    def release(self, bucket: Bucket) -> None:
        """Free ``bucket``'s whole params (after its backward: its gradients are in)."""
        if bucket.index not in self._unit_of:
            return
        self._wait(bucket)
        bucket.buffer.release(bucket)
        u = self._unit_of[bucket.index]
        if u in self._in_backward and all(not b.materialized for b in self.units[u]):
            self._in_backward.discard(u)
            if u - 1 in self._in_backward:  # the next backward's turn: prefetch the one after
                self._prefetch(u, u - 2)

    def release_all(self) -> None:
        """Free every unit (end of a step: a unit whose params got no gradient stays
        gathered until here)."""
        for buckets in self.units:
            for bucket in buckets:
                self.release(bucket)
        self._in_backward.clear()

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Every unit's whole params, for reading (or, with ``write_back``, loading)
        weights outside forward and backward; freed again after (the shards first take
        what was written into the whole params, when ``write_back``)."""
        for buckets in self.units:
            for bucket in buckets:
                self._gather(bucket)
        for buckets in self.units:
            for bucket in buckets:
                self._wait(bucket)
        try:
            yield
        finally:
            for buckets in self.units:
                for bucket in buckets:
                    if write_back:
                        lo, hi = bucket.shard(*bucket.buffer.shard)
                        shard = bucket.full_params[lo - bucket.start : hi - bucket.start]
                        bucket.buffer.owned_params(bucket).copy_(shard)
            self.release_all()

    # -- hooks --------------------------------------------------------------------------
    def _pre(self, u: int, module: nn.Module, args) -> None:
        self._gather_unit(u, u + 1)

    def _post(self, u: int, module: nn.Module, args, output):
        if torch.is_grad_enabled():  # (a recompute's outputs get no gradient: harmless)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))
        if u in self._in_backward:  # a recompute inside the unit's backward, or another
            return output  # micro-batch's forward before this one's weight gradients
        for bucket in self.units[u]:
            self.release(bucket)
        return output

    def _pre_backward(self, u: int, grad: torch.Tensor) -> None:
        """Gather unit ``u`` for its backward; prefetch the previous unit unless the next
        one is still gathered (its last gradients have not arrived: ``release`` will
        prefetch when they have), so at most two units are whole at a time."""
        self._in_backward.add(u)
        busy = self._near(u, u + 1) and any(b.materialized for b in self.units[u + 1])
        self._gather_unit(u, None if busy else u - 1)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
