"""Execute one rank's action list: forward, backward and stage-to-stage transfers.

A fused batch of comm actions goes out as one ``Collective.batch_send_recv``
call and is not waited on: a compute action waits only for the receive it
needs, and sends are waited for at the end of the step. So sends overlap the
next compute, and a receive posted a unit early (interleaving) overlaps the
compute in between.

Two ways to describe what crosses a stage boundary:

- a plain shape (``[micro-batch, seq, hidden]``): one tensor of ``dtype``; a chunk
  maps a tensor (or, on virtual stage 0, the micro-batch input) to a tensor, and
  the last stage adds ``loss_fn(output, target) / m`` per micro-batch;
- named messages (``messages(boundary) -> {name: TensorSpec}``, the model-family
  seam): several tensors per boundary, each with its own shape and dtype, which may
  change from one boundary to the next. A chunk's ``stage(inputs, batch)`` maps the
  received tensors and the whole micro-batch (every stage reads its side inputs)
  to the next boundary's tensors; the last stage's outputs go to
  ``loss_fn(outputs, batch)``, which returns the micro-batch's loss as it should be
  backpropagated (already weighted; the runner does not divide by m). Gradients
  travel back for the floating-point tensors.

In a schedule that splits the backward (zero bubble: ``backward`` and ``weight``
actions), a forward runs under ``deferring_weight_grads`` with a store of its own;
``backward`` (B) takes, in one ``torch.autograd.grad`` call, the gradients of the
chunk's inputs and of its parameters but the linears' weights (which go to the
store), and sends the former at once; ``weight`` (W) computes the deferred
products and hands every parameter gradient of the micro-batch to autograd
(``weight_grad.hand_over``): accumulation and the data-parallel hooks see what they
see in an unsplit backward, only later.

Per step the runner records compute time (busy) and time in communication
calls (wait: posting batches, waiting for receives and, at the end, sends);
the rest of the step (bookkeeping) is neither. The same places are the named ranges of a
trace (``mtcore.backend.tracing``): each compute action (``forward``/``backward``/``weight``,
with its micro-batch and chunk; from its receive's arrival to its end), each posted batch
of transfers, and each wait: for a receive (the ``bubble``: this rank idles on its peer
stage) or for a send. For a bubble measurement, synchronise the ranks before and after
``step`` and use ``1 - busy / window`` (see benchmarks/bench_pipeline.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mtcore.backend import tracing
from mtcore.backend.collective import P2P
from mtcore.parallel.pipeline.groups import PipelineGroups
from mtcore.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    WEIGHT,
    Action,
    Schedule,
    ScheduleError,
    is_first_stage,
    is_last_stage,
    peer,
)
from mtcore.parallel.tensor.weight_grad import (
    WeightGradStore,
    deferring_weight_grads,
    hand_over,
)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor that crosses a pipeline boundary (known before the
    step, so receives can be posted early)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StepStats:
    """One step on one rank. ``loss``: mean over micro-batches (last stage only).
    ``trace`` (when asked for): every compute action with its start and end, in
    seconds from the start of the step."""

    loss: float | None
    busy_s: float
    wait_s: float
    total_s: float
    peak_in_flight: int
    trace: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_undelivered: int = 0  # the most sends whose tensors this rank held at once
    busy_cpu_s: float = 0.0  # this thread's CPU time in the compute (waits in it cost none)

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class PipelineRunner:
    """Run ``schedule`` for this rank with its ``chunks`` (one module per chunk).

    chunks[c] maps the received activation (or, on virtual stage 0, the
    micro-batch input) to its output; on the last virtual stage the output
    goes to ``loss_fn(output, target)``. A chunk with ``no_sync()`` (a
    DataParallel wrapper), or ``grad_sync`` (one DataParallel over every chunk,
    with a buffer per chunk), runs every backward of a chunk but the chunk's last
    under ``no_sync``, so each chunk's gradients are reduced once per step, launched
    as soon as that chunk is done while the other chunks' backward goes on.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: Schedule,
        groups: PipelineGroups,
        backend,
        tensor_shape: Sequence[int] | Callable[[int], dict],
        loss_fn: Callable[[Tensor, object], Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = True,
        trace: bool = False,
        grad_sync: object | None = None,
    ):
        if len(chunks) != schedule.vpp:
            raise ScheduleError(
                f"schedule has vpp={schedule.vpp} chunks per rank, got {len(chunks)} modules"
            )
        if schedule.pp != groups.pp:
            raise ScheduleError(
                f"schedule is for pp={schedule.pp}, the pipeline has {groups.pp} stages"
            )
        self.chunks, self.schedule, self.groups = list(chunks), schedule, groups
        self.collective, self.device = backend.collective, backend.torch_device()
        self._sync = backend.device.synchronize
        self.rank, self.pp, self.vpp = groups.pp_rank, schedule.pp, schedule.vpp
        self.actions = schedule.for_rank(self.rank)
        self.named = callable(tensor_shape)
        if self.named:  # boundary -> {name: spec with .shape and .dtype}
            self.messages = tensor_shape
        else:
            spec = TensorSpec(tuple(tensor_shape), dtype)
            self.messages = lambda boundary: {"": spec}
        self.dtype, self.loss_fn = dtype, loss_fn
        self.grad_sync = grad_sync  # a DataParallel: no_sync() for all but a chunk's last backward
        self.timing, self.trace = timing, trace
        self.has_first = is_first_stage(self.rank, 0)
        self.has_last = is_last_stage(self.rank, self.vpp - 1, self.pp, self.vpp)
        if self.has_last and loss_fn is None:
            raise ValueError("the last pipeline stage needs a loss_fn")
        self._delivered_by = schedule.delivered_by(self.rank)
        # the action after which a chunk's gradients are complete: its last B, or W
        self.split = schedule.splits_backward
        accumulates = WEIGHT if self.split else BACKWARD
        last = {a.chunk: i for i, a in enumerate(self.actions) if a.kind == accumulates}
        self._reduce_at = set(last.values())

    # -- one step ----------------------------------------------------------------------
    def step(self, inputs: Sequence | None = None, targets: Sequence | None = None) -> StepStats:
        """Run every micro-batch forward and backward; gradients accumulate in the chunks."""
        m = self.schedule.microbatches
        if (self.has_first or self.named) and (inputs is None or len(inputs) != m):
            who = "every stage" if self.named else "the first stage"
            raise ValueError(f"{who} needs {m} micro-batch inputs, got {_len(inputs)}")
        if self.has_last and not self.named and (targets is None or len(targets) != m):
            raise ValueError(f"the last stage needs {m} micro-batch targets, got {_len(targets)}")
        self._inputs, self._targets = inputs, targets
        self._saved: dict[tuple[int, int], tuple[dict[str, Tensor], object, object]] = {}
        self._weights_due: dict[tuple[int, int], tuple[WeightGradStore, list]] = {}
        self._outgoing: dict[Action, dict[str, Tensor]] = {}
        self._recv: dict[Action, tuple[dict[str, Tensor], list]] = {}
        self._sends: dict[Action, tuple[dict[str, Tensor], list, bool]] = {}
        self._most_sends = 0
        self._losses: list[Tensor] = []
        self._busy = self._wait = self._busy_cpu = 0.0
        self._peak = 0
        self._trace: list[tuple[Action, float, float]] = []
        self._t0 = time.perf_counter()
        actions, i = self.actions, 0
        while i < len(actions):
            if actions[i].is_compute:
                self._compute(actions[i], i)
                i += 1
                continue
            j = i
            while j < len(actions) and not actions[j].is_compute:
                j += 1
            self._post(actions[i:j])
            i = j
        with tracing.phase("wait sends", "comm"):
            for _, handles, _ in self._sends.values():
                self._wait_all(handles)
        self._sends = {}  # delivered: keep no sent tensor through the optimizer step
        total = time.perf_counter() - self._t0
        if self._saved or self._outgoing or self._recv or self._weights_due:
            raise ScheduleError(
                f"rank {self.rank}: step ended with unfinished work (action list is inconsistent)"
            )
        loss = torch.stack(self._losses).sum().item() if self._losses else None
        return StepStats(
            loss, self._busy, self._wait, total, self._peak, self._trace, self._most_sends,
            self._busy_cpu,
        )

    def _forward(self, c: int, inputs: dict[str, Tensor], batch) -> dict[str, Tensor] | Tensor:
        """Chunk ``c`` on one micro-batch: ``stage(inputs, batch)`` for named messages;
        for a plain shape, the chunk on the received tensor (or the input on stage 0)."""
        if self.named:
            return self.chunks[c].stage(inputs, batch)
        out = self.chunks[c](inputs[""] if inputs else batch)
        return out if is_last_stage(self.rank, c, self.pp, self.vpp) else {"": out}

    def _loss(self, out, mb: int) -> Tensor:
        if self.named:
            return self.loss_fn(out, self._inputs[mb])
        return self.loss_fn(out, self._targets[mb]) / self.schedule.microbatches

    # -- transfers -----------------------------------------------------------------------
    def _post(self, batch: Sequence[Action]) -> None:
        with tracing.phase("p2p post", "comm", actions=batch):
            self._post_batch(batch)

    def _post_batch(self, batch: Sequence[Action]) -> None:
        start = time.perf_counter()
        self._drop_delivered()
        ops, kept = [], []
        for a in batch:
            dst = self.groups.ranks[peer(a, self.rank, self.pp)]
            if a.kind in (SEND_FWD, SEND_BWD):
                tensors = self._outgoing.pop(a)
                kind = "send"
            else:
                tensors = self._allocate(a)
                kind = "recv"
            first = len(ops)
            ops.extend(P2P(kind, t, dst, self.groups.group) for t in tensors.values())
            kept.append((a, tensors, first))
        handles = self.collective.batch_send_recv(ops) if ops else []
        per_op = len(handles) == len(ops)  # gloo: one work per op; NCCL: one for the batch
        for a, tensors, first in kept:
            mine = handles[first : first + len(tensors)] if per_op else handles
            if a.kind in (SEND_FWD, SEND_BWD):
                self._sends[a] = (tensors, mine, per_op)
            else:
                self._recv[a] = (tensors, mine)
        self._most_sends = max(self._most_sends, len(self._sends))
        # gloo writes a send in the caller's thread once the peer's receive is
        # posted, so posting is communication time too
        self._wait += time.perf_counter() - start

    def _drop_delivered(self, received: Action | None = None) -> None:
        """Let go of the tensors of sends known to be delivered, so that a step holds
        the messages still travelling, not one per micro-batch (the gradients sent back
        would otherwise pile up until the step ends). Known: the handles say so
        (``is_completed``: NCCL, MCCL), or ``received`` has just arrived and proves it
        (``Schedule.delivered_by``: gloo's send handles complete only when waited for).
        Waiting on such a send returns at once; it raises a failed send's error."""
        proven = self._delivered_by.get(received, ()) if received is not None else ()
        for action in list(self._sends):
            _, handles, own = self._sends[action]
            if (own and action in proven) or all(h.is_completed() for h in handles):
                self._wait_all(handles)
                del self._sends[action]

    def _boundary(self, a: Action) -> int:
        """The virtual-stage boundary an action's tensors cross (sender's stage)."""
        stage = a.chunk * self.pp + self.rank
        return stage if a.kind in (SEND_FWD, RECV_BWD) else stage - 1

    def _allocate(self, a: Action) -> dict[str, Tensor]:
        specs = self.messages(self._boundary(a))
        if a.kind == RECV_BWD:  # gradients come back for the floating-point tensors only
            specs = {n: s for n, s in specs.items() if s.dtype.is_floating_point}
        return {
            n: torch.empty(s.shape, dtype=s.dtype, device=self.device) for n, s in specs.items()
        }

    def _received(self, kind: str, mb: int, chunk: int) -> dict[str, Tensor]:
        action = Action(kind, mb, chunk)
        tensors, handles = self._recv.pop(action)
        with tracing.phase(kind, "bubble", microbatch=mb, chunk=chunk):
            self._wait_all(handles)
        self._drop_delivered(action)
        return tensors

    def _wait_all(self, handles) -> None:
        start = time.perf_counter()
        for h in handles:
            h.wait()
        self._wait += time.perf_counter() - start

    def _to_send(self, a: Action, tensors: dict[str, Tensor]) -> None:
        specs = self.messages(self._boundary(a))
        if a.kind == SEND_BWD:
            specs = {n: s for n, s in specs.items() if s.dtype.is_floating_point}
        if set(tensors) != set(specs):
            raise ScheduleError(
                f"rank {self.rank}: {a} sends {sorted(tensors)}, but the pipeline moves "
                f"{sorted(specs)} across boundary {self._boundary(a)}"
            )
        for name, tensor in tensors.items():
            spec = specs[name]
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                what = f" {name!r}" if name else ""
                raise ScheduleError(
                    f"rank {self.rank}: {a}{what} has shape {tuple(tensor.shape)} {tensor.dtype}, "
                    f"but the pipeline moves {tuple(spec.shape)} {spec.dtype} (tensor_shape / dtype)"
                )
        # In the specs' order: the receiver posts its receives in that order.
        self._outgoing[a] = {n: tensors[n].detach().contiguous() for n in specs}

    # -- compute -------------------------------------------------------------------------
    def _compute(self, a: Action, index: int) -> None:
        mb, c = a.microbatch, a.chunk
        first, last = is_first_stage(self.rank, c), is_last_stage(self.rank, c, self.pp, self.vpp)
        if a.kind == FORWARD:
            inputs = {}
            if not first:
                inputs = self._received(RECV_FWD, mb, c)
                for tensor in inputs.values():
                    if tensor.dtype.is_floating_point:
                        tensor.requires_grad_()
            span = self._span(a)
            start = time.perf_counter()
            cpu_start = time.thread_time()
            store = WeightGradStore() if self.split else None
            with deferring_weight_grads(store):
                out = self._forward(c, inputs, self._inputs[mb] if self.named or first else None)
            if last:
                out = self._loss(out, mb)
                self._losses.append(out.detach())
            else:
                self._to_send(Action(SEND_FWD, mb, c), out)
            self._saved[(mb, c)] = (inputs, out, store)
            self._peak = max(self._peak, len(self._saved) + len(self._weights_due))
        elif a.kind == BACKWARD:
            inputs, out, store = self._saved.pop((mb, c))
            grads = None if last else self._received(RECV_BWD, mb, c)
            span = self._span(a)
            start = time.perf_counter()
            cpu_start = time.thread_time()
            if last:
                roots, root_grads = [out], None
            else:  # a message computed from the batch alone carries no gradient
                names = [n for n in grads if out[n].requires_grad]
                roots, root_grads = [out[n] for n in names], [grads[n] for n in names]
            floats = {n: t for n, t in inputs.items() if t.dtype.is_floating_point}
            if self.split:
                back = self._input_grads(c, mb, store, floats, roots, root_grads)
            else:
                with self._sync_context(c, index):
                    if roots:
                        torch.autograd.backward(roots, root_grads)
                back = {n: t.grad for n, t in floats.items()}
            if not first:
                back = {n: torch.zeros_like(t) if back[n] is None else back[n] for n, t in floats.items()}
                self._to_send(Action(SEND_BWD, mb, c), back)
        else:
            span = self._span(a)
            start = time.perf_counter()
            cpu_start = time.thread_time()
            store, own = self._weights_due.pop((mb, c))
            params = [p for p, _ in own] + store.weights()

            def grads(own=own, store=store) -> list[Tensor]:
                found = [g for _, g in own] + [g for _, g in store.compute()]
                own.clear()  # accumulation takes them over
                return found

            with self._sync_context(c, index):
                if params:  # accumulate as an unsplit backward would, hooks included
                    hand_over(params, grads)
        if self.timing:
            self._sync()
        end = time.perf_counter()
        span.__exit__(None, None, None)
        self._busy += end - start
        self._busy_cpu += time.thread_time() - cpu_start
        if self.trace:
            self._trace.append((a, start - self._t0, end - self._t0))


    @staticmethod
    def _span(a: Action):
        """The compute action's trace range (opened after its receive: the wait for that
        is a range of its own, the bubble), closed by ``_compute`` as it ends."""
        span = tracing.phase(a.kind, "compute", microbatch=a.microbatch, chunk=a.chunk)
        span.__enter__()
        return span

    def _sync_context(self, c: int, index: int):
        """``no_sync`` of the chunk's data-parallel wrapper but where its gradients
        complete, so each chunk's gradients are reduced once per step."""
        sync = self.grad_sync if self.grad_sync is not None else self.chunks[c]
        quiet = index not in self._reduce_at and hasattr(sync, "no_sync")
        return sync.no_sync() if quiet else contextlib.nullcontext()

    def _input_grads(self, c, mb, store, floats, roots, root_grads) -> dict[str, Tensor | None]:
        """B of the split backward: the gradients of the chunk's inputs (returned) and
        of its parameters but the deferred weights (kept with ``store`` for W)."""
        params = [p for p in self.chunks[c].parameters() if p.requires_grad]
        wanted = list(floats.values()) + params
        found = [None] * len(wanted)
        if roots and wanted:  # recompute runs the forward again here: the same linears
            with deferring_weight_grads(store):
                found = torch.autograd.grad(roots, wanted, root_grads, allow_unused=True)
        back = dict(zip(floats, found[: len(floats)], strict=True))
        own = [(p, g) for p, g in zip(params, found[len(floats) :], strict=True) if g is not None]
        self._weights_due[(mb, c)] = (store, own)
        return back


def _len(x) -> str:
    return "none" if x is None else str(len(x))
