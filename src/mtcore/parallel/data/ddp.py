"""Data parallelism with bucketed, overlapped gradient reduction (Megatron-Core's DDP).

Gradients go into contiguous fp32 buffers (``GradBuffer``) through
post-accumulate-grad hooks; the hook that completes a bucket launches that
bucket's reduction asynchronously, so communication runs while backward
computes the earlier layers. ``finish_grad_sync()`` launches what is left and
waits. Under ``no_sync()`` (gradient accumulation) hooks only accumulate.

The reduction is an fp32 average over the data-parallel group ``dp_cp`` (replicas
across data and context parallel ranks hold the same params): each gradient enters the
buffer already divided by dp x cp, and the buckets are summed. This module is the
reducer: buckets, hooks, overlap, launches and waits. What a ZeRO stage changes (the
collective, the buffer layout, what lives between reductions) is its strategy
(``zero.py``: ``Replicated``, ``ShardedOptimizer``, ``ShardedGradients``,
``ShardedParameters``), picked from the strategy table (``strategies.py``) by the
``DataParallelConfig`` flags.

Mixture-of-experts expert params (``param.expert_parallel = True``) live in
buffers of their own, reduced over the expert-data-parallel group ``edp``
only (the ranks holding the same experts). They are still divided by the whole
``dp_cp`` size: the all-to-all backward already summed into each expert the
gradients of the tokens of every rank of its expert-parallel group, so the sum
over ``edp`` covers every data-parallel rank once, and 1/(dp x cp) makes it the mean.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mtcore.backend import tracing
from mtcore.parallel.clip import is_expert_parallel
from mtcore.parallel.data.buffer import Bucket, GradBuffer
from mtcore.parallel.data.config import DataParallelConfig
from mtcore.parallel.data.strategies import stage_of
from mtcore.parallel.layout import Axis


@dataclass(frozen=True)
class LaunchRecord:
    """One bucket reduction: which bucket, how many param grads of its chunk's running
    backward had not arrived yet (0 for launches from ``finish_grad_sync``), the model
    chunk it belongs to and when it was launched (``time.perf_counter()``, comparable
    between the processes of one machine)."""

    bucket: int
    pending_grads: int
    from_backward: bool
    chunk: int = 0
    time_s: float = 0.0


class DataParallel(torch.nn.Module):
    """Wrap ``module`` for data parallelism over ``layout``'s ``dp_cp`` group.

    Every trainable param becomes a view into a flat buffer of its dtype and gets
    ``param.main_grad``, a view into the fp32 gradient buffer; ``param.grad`` is
    left None after backward (the gradient lives in ``main_grad``, divided by dp x cp
    until ``finish_grad_sync()`` has summed it). Cast the module to its final
    dtype and device before wrapping it: a later ``.to()`` would detach the
    params from the buffers.

    chunks: the model chunks ``module`` holds (pipeline virtual stages), when it holds
    several: each chunk's params get buffers of their own, so no bucket spans two
    chunks and a chunk's buckets are launched by that chunk's last backward (the
    pipeline runner runs the others under ``no_sync``), while the other chunks'
    backward goes on. deferred: params whose buckets backward must not launch
    (halves of a tied weight split over pipeline stages: they are summed over the
    stages first, then ``finish_grad_sync`` reduces them over dp); they get buffers
    of their own too. units: the modules (in forward order) whose params ZeRO-3 shards,
    one bucket per unit and buffer kind (with ``shard_params``; other params stay whole).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        layout,
        backend,
        config: DataParallelConfig | None = None,
        *,
        chunks: Sequence[torch.nn.Module] | None = None,
        deferred: Sequence[torch.nn.Parameter] = (),
        units: Sequence[torch.nn.Module] = (),
    ):
        super().__init__()
        self.module = module
        self.config = config or DataParallelConfig()
        self.layout = layout
        self.backend = backend
        self.collective = backend.collective
        self.stage = stage_of(self.config)  # the ZeRO stage's strategy
        self.group = layout.dp_cp.group
        self.dp_cp_size, self.dp_cp_rank = layout.dp_cp.size, layout.dp_cp.rank
        # The average's 1/(dp x cp) is applied as gradients enter the buffer (free inside
        # the accumulating add) so the reduction is a plain sum: no extra pass
        # over the bucket where a backend lacks a native average (gloo).
        self._grad_scale = 1.0 / self.dp_cp_size if self.config.average else 1.0

        # (group, size, this rank's index) of each reduction group a buffer may use.
        self.reductions: dict[Axis, tuple[object, int, int]] = {
            Axis.DP_CP: (self.group, self.dp_cp_size, self.dp_cp_rank)
        }
        params = [p for p in module.parameters() if p.requires_grad]
        chunk_of = {id(p): c for c, ch in enumerate(chunks or [module]) for p in ch.parameters()}
        missing = [p for p in params if id(p) not in chunk_of]
        if missing:
            raise ValueError(f"{len(missing)} trainable params of the module are in no chunk")
        deferred_ids = {id(p) for p in deferred}
        unit_of = {}  # ZeRO-3: param -> its unit
        if self.config.shard_params:
            unit_of = {id(p): u for u, m in enumerate(units) for p in m.parameters()}
        # (reduce group, chunk, deferred, ZeRO-3, dtype) -> params, in module order
        by_kind: dict[tuple[Axis, int, bool, bool, torch.dtype], list] = {}
        for p in params:
            kind = Axis.EDP if is_expert_parallel(p) else Axis.DP_CP
            sharded = id(p) in unit_of and id(p) not in deferred_ids
            key = (kind, chunk_of[id(p)], id(p) in deferred_ids, sharded, p.dtype)
            by_kind.setdefault(key, []).append(p)
        if any(key[0] is Axis.EDP for key in by_kind):
            self.reductions[Axis.EDP] = (
                layout.edp.group,
                layout.edp.size,
                layout.edp.rank,
            )
        self.grad_buffers: list[GradBuffer] = []
        order = sorted(by_kind.items(), key=lambda item: (item[0][0] is Axis.EDP, *item[0][1:3]))
        for (kind, chunk, later, sharded, _), group in order:
            _, size, rank = self.reductions[kind]
            pad_to = self.stage.pad_to(size)
            first = sum(len(b.buckets) for b in self.grad_buffers)
            shard = self.stage.gradient_shard(rank, size, deferred=later)
            groups = None
            if sharded:  # one bucket per unit
                by_unit: dict[int, list] = {}
                for p in group:
                    by_unit.setdefault(unit_of[id(p)], []).append(p)
                groups = [by_unit[u] for u in sorted(by_unit)]
            buf = GradBuffer(group, self.config.bucket_size, pad_to, first, reduce_group=kind,
                             shard=shard, groups=groups, shard_params=sharded)  # fmt: skip
            buf.chunk, buf.deferred = chunk, later
            self.grad_buffers.append(buf)
        self.device = self.grad_buffers[0].device if self.grad_buffers else torch.device("cpu")
        self.buckets: list[Bucket] = [b for buf in self.grad_buffers for b in buf.buckets]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._buffer_of = {id(p): buf for buf in self.grad_buffers for p in buf.params}
        self._chunk_of = chunk_of
        self._chunk_params = [0] * len(chunks or [module])
        for p in params:
            self._chunk_params[chunk_of[id(p)]] += 1
        # Replicated params that saw only a sequence shard under sequence
        # parallelism: their gradient is a partial sum over tp (Megatron sums
        # them in finalize_model_grads; here in finish_grad_sync, on main_grad).
        self._sp_params = [p for p in params if getattr(p, "sequence_parallel", False)]

        # False: backward and finish_grad_sync leave the data-parallel reduction out
        # (1-bit Adam's compression stage reduces the momentum instead).
        self.reduce_gradients = True
        self._sync = True
        self._synced = True
        self._seen: list[set[int]] = [set() for _ in self._chunk_params]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._handles: dict[int, object] = {}
        self._in_trace: dict[int, object] = {}  # bucket index -> its reduction's trace range
        self.launch_log: list[LaunchRecord] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.stage.attach(self, units)

    @property
    def sharded_params(self):
        """ZeRO-3's gather and free of the units' params (None below ZeRO-3)."""
        return self.stage.sharded_params

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- gradient accumulation --------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last micro-batch);
        ZeRO-2 buckets reduce anyway, into the shard that accumulates."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:
            return
        bucket = self._bucket_of[id(param)]
        self.stage.before_grad(self, bucket)
        param.main_grad.add_(param.grad, alpha=self._grad_scale)
        param.grad = None
        self._synced = False
        chunk = self._chunk_of[id(param)]
        seen = self._seen[chunk]
        seen.add(id(param))
        pending = self._chunk_params[chunk] - len(seen)
        if pending == 0:
            seen.clear()
        ready = self._ready[bucket.index]
        ready.add(id(param))
        if len(ready) == len(bucket.params):
            ready.clear()
            every = self.stage.reduces_every_microbatch(bucket)  # ZeRO-2, 3
            launch = (self._sync and self.config.overlap_grad_reduce) or every
            if launch and self.reduce_gradients and not bucket.buffer.deferred:
                self._launch(bucket, pending, from_backward=True)
            self.stage.after_backward(bucket)

    def _launch(self, bucket: Bucket, pending: int, from_backward: bool) -> None:
        if bucket.index in self._handles:
            return
        self.launch_log.append(
            LaunchRecord(
                bucket.index, pending, from_backward, bucket.buffer.chunk, time.perf_counter()
            )
        )
        group, size, rank = self.reduction_of(bucket)
        scatter = bucket.buffer.shard is not None or self.config.shard_optimizer
        how = "reduce-scatter" if scatter else "all-reduce"
        # A trace shows each reduction from its launch to its completion, beside the
        # backward it may overlap (its exposed part is the wait in finish_grad_sync).
        self._in_trace[bucket.index] = tracing.begin(
            f"dp {how} bucket {bucket.index}", "comm", bucket=bucket.index, chunk=bucket.buffer.chunk
        )
        self._handles[bucket.index] = self.stage.reduce(self, bucket, group, size, rank)

    def in_flight(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s reduction was launched and not waited for."""
        return bucket.index in self._handles

    def wait_for(self, index: int) -> None:
        """Wait for bucket ``index``'s reduction, if one is in flight."""
        handle = self._handles.pop(index, None)
        if handle is not None:
            handle.wait()
        tracing.end(self._in_trace.pop(index, None))

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (in bucket order) and wait for all.

        Idempotent until the next backward. Buckets are launched in the same order
        on every rank as long as every rank's backward reaches the same params.
        With ``reduce_gradients`` False the buckets keep this rank's own gradients
        (divided by dp x cp); only the sequence-parallel sums over tp run.
        """
        if self._synced:
            return
        for bucket in self.buckets if self.reduce_gradients else ():
            if bucket.index not in self._handles and self.stage.launches_at_finish(bucket):
                self._launch(bucket, 0, from_backward=False)
        for index in list(self._handles):  # in launch order
            self.wait_for(index)
        self.stage.finish(self)
        self._sum_sequence_parallel_grads()
        for seen in self._seen:
            seen.clear()
        for ready in self._ready:
            ready.clear()
        self._synced = True

    def _sum_sequence_parallel_grads(self) -> None:
        if not self._sp_params or self.layout.tp == 1:
            return
        grads = [g for p in self._sp_params for g in self._reduced_grads(p)]
        if not grads:  # ZeRO-2: this dp rank's shards hold none (nor do its tp peers')
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.collective.all_reduce(flat, op="sum", group=self.layout.group(Axis.TP))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _reduced_grads(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """Where ``param``'s reduced gradient lives: ``main_grad``, or under ZeRO-2 the
        part of it inside this rank's shard (the same size on every tp rank)."""
        buf = self._buffer_of[id(param)]
        if buf.shard is None:
            return [param.main_grad]
        start, end = buf.range_of(param)
        lo, hi = self.owned_ranges(self._bucket_of[id(param)])
        start, end = max(start, lo), min(end, hi)
        return [buf.grad_range(start, end)] if start < end else []

    def zero_grad_buffer(self) -> None:
        """Zero the fp32 gradients before the first micro-batch of a step."""
        if self._handles:
            raise RuntimeError(
                "zero_grad_buffer() while reductions are in flight; call finish_grad_sync()"
            )
        for buf in self.grad_buffers:
            buf.grad.zero_()
            for p in buf.params:
                p.grad = None
        self.stage.zero_grad(self)
        for seen in self._seen:
            seen.clear()
        for ready in self._ready:
            ready.clear()
        self._synced = True
        self.launch_log.clear()

    def gathered_params(self, write_back: bool = False) -> contextlib.AbstractContextManager:
        """Every param whole inside the ``with`` (ZeRO-3 gathers its units; a no-op
        otherwise); ``write_back``: what is written into them is kept."""
        return self.stage.gathered(write_back)

    # -- queries ------------------------------------------------------------------
    def buffer_of(self, param: torch.nn.Parameter) -> GradBuffer:
        return self._buffer_of[id(param)]

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self._bucket_of[id(param)]

    def reduction_of(self, bucket: Bucket) -> tuple[object, int, int]:
        """(group, size, this rank's index) that ``bucket`` is reduced (and sharded) over:
        ``dp_cp``, or ``edp`` for expert params."""
        return self.reductions[bucket.buffer.reduce_group]

    def owned_ranges(self, bucket: Bucket) -> tuple[int, int]:
        """The ``[start, end)`` of ``bucket`` whose reduced gradient this rank holds."""
        _, size, rank = self.reduction_of(bucket)
        return self.stage.owned_range(bucket, size, rank)
