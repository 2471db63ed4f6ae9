"""Execute one rank's action list: forward, backward and stage-to-stage transfers.

A fused batch of comm actions goes out as one ``Collective.batch_send_recv``
call and is not waited on: a compute action waits only for the receive it
needs, and sends are waited for at the end of the step. So sends overlap the
next compute, and a receive posted a unit early (interleaving) overlaps the
compute in between. Every transfer has the shape given up front
(``[micro-batch, seq, hidden]`` for a transformer, seq / tp under sequence
parallel). The last stage adds ``loss_fn(output, target) / m`` per micro-batch.

Per step the runner records compute time (busy) and time in communication
calls (wait: posting batches, waiting for receives and, at the end, sends);
the rest of the step (bookkeeping) is neither. For a bubble measurement, synchronise the ranks before and after
``step`` and use ``1 - busy / window`` (see benchmarks/bench_pipeline.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mtcore.backend.collective import P2P
from mtcore.parallel.pipeline.groups import PipelineGroups
from mtcore.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    Action,
    Schedule,
    ScheduleError,
    is_first_stage,
    is_last_stage,
    peer,
)


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

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class PipelineRunner:
    """Run ``schedule`` for this rank with its ``chunks`` (one module per chunk).

    chunks[c] maps the received activation (or, on virtual stage 0, the
    micro-batch input) to its output; on the last virtual stage the output
    goes to ``loss_fn(output, target)``. A chunk with ``no_sync()`` (a
    DataParallel wrapper) runs every backward but its last under it, so
    gradients are reduced once per step.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: Schedule,
        groups: PipelineGroups,
        backend,
        tensor_shape: Sequence[int],
        loss_fn: Callable[[Tensor, object], Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        timing: bool = True,
        trace: bool = False,
    ):
        if len(chunks) != schedule.vpp:
            raise ScheduleError(f"schedule has vpp={schedule.vpp} chunks per rank, got {len(chunks)} modules")
        if schedule.pp != groups.pp:
            raise ScheduleError(f"schedule is for pp={schedule.pp}, the pipeline has {groups.pp} stages")
        self.chunks, self.schedule, self.groups = list(chunks), schedule, groups
        self.collective, self.device = backend.collective, backend.torch_device()
        self._sync = backend.device.synchronize
        self.rank, self.pp, self.vpp = groups.pp_rank, schedule.pp, schedule.vpp
        self.actions = schedule.for_rank(self.rank)
        self.shape, self.dtype, self.loss_fn = tuple(tensor_shape), dtype, loss_fn
        self.timing, self.trace = timing, trace
        self.has_first = is_first_stage(self.rank, 0)
        self.has_last = is_last_stage(self.rank, self.vpp - 1, self.pp, self.vpp)
        if self.has_last and loss_fn is None:
            raise ValueError("the last pipeline stage needs a loss_fn")
        last_b = {a.chunk: i for i, a in enumerate(self.actions) if a.kind == BACKWARD}
        self._reduce_at = set(last_b.values())

    # -- one step ----------------------------------------------------------------------
    def step(self, inputs: Sequence | None = None, targets: Sequence | None = None) -> StepStats:
        """Run every micro-batch forward and backward; gradients accumulate in the chunks."""
        m = self.schedule.microbatches
        if self.has_first and (inputs is None or len(inputs) != m):
            raise ValueError(f"the first stage needs {m} micro-batch inputs, got {_len(inputs)}")
        if self.has_last and (targets is None or len(targets) != m):
            raise ValueError(f"the last stage needs {m} micro-batch targets, got {_len(targets)}")
        self._inputs, self._targets = inputs, targets
        self._saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self._outgoing: dict[Action, Tensor] = {}
        self._recv: dict[Action, tuple[Tensor, list]] = {}
        self._sends: list[tuple[Tensor, list]] = []
        self._losses: list[Tensor] = []
        self._busy = self._wait = 0.0
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
        for _, handles in self._sends:
            self._wait_all(handles)
        total = time.perf_counter() - self._t0
        if self._saved or self._outgoing or self._recv:
            raise ScheduleError(f"rank {self.rank}: step ended with unfinished work (action list is inconsistent)")
        loss = torch.stack(self._losses).sum().item() if self._losses else None
        return StepStats(loss, self._busy, self._wait, total, self._peak, self._trace)

    # -- transfers -----------------------------------------------------------------------
    def _post(self, batch: Sequence[Action]) -> None:
        start = time.perf_counter()
        ops, kept = [], []
        for a in batch:
            dst = self.groups.ranks[peer(a, self.rank, self.pp)]
            if a.kind in (SEND_FWD, SEND_BWD):
                tensor = self._outgoing.pop(a)
                ops.append(P2P("send", tensor, dst, self.groups.group))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(P2P("recv", tensor, dst, self.groups.group))
            kept.append((a, tensor))
        handles = self.collective.batch_send_recv(ops)
        per_op = len(handles) == len(ops)  # gloo: one work per op; NCCL: one for the batch
        for k, (a, tensor) in enumerate(kept):
            mine = [handles[k]] if per_op else handles
            if a.kind in (SEND_FWD, SEND_BWD):
                self._sends.append((tensor, mine))
            else:
                self._recv[a] = (tensor, mine)
        # gloo writes a send in the caller's thread once the peer's receive is
        # posted, so posting is communication time too
        self._wait += time.perf_counter() - start

    def _received(self, kind: str, mb: int, chunk: int) -> Tensor:
        tensor, handles = self._recv.pop(Action(kind, mb, chunk))
        self._wait_all(handles)
        return tensor

    def _wait_all(self, handles) -> None:
        start = time.perf_counter()
        for h in handles:
            h.wait()
        self._wait += time.perf_counter() - start

    def _to_send(self, a: Action, tensor: Tensor) -> None:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ScheduleError(
                f"rank {self.rank}: {a} has shape {tuple(tensor.shape)} {tensor.dtype}, but the "
                f"pipeline moves {self.shape} {self.dtype} (tensor_shape / dtype)"
            )
        self._outgoing[a] = tensor.detach().contiguous()

    # -- compute -------------------------------------------------------------------------
    def _compute(self, a: Action, index: int) -> None:
        mb, c = a.microbatch, a.chunk
        first, last = is_first_stage(self.rank, c), is_last_stage(self.rank, c, self.pp, self.vpp)
        if a.kind == FORWARD:
            x = inp = None
            if first:
                x = self._inputs[mb]
            else:
                x = inp = self._received(RECV_FWD, mb, c).requires_grad_()
            start = time.perf_counter()
            out = self.chunks[c](x)
            if last:
                out = self.loss_fn(out, self._targets[mb]) / self.schedule.microbatches
                self._losses.append(out.detach())
            else:
                self._to_send(Action(SEND_FWD, mb, c), out)
            self._saved[(mb, c)] = (inp, out)
            self._peak = max(self._peak, len(self._saved))
        else:
            inp, out = self._saved.pop((mb, c))
            grad = None if last else self._received(RECV_BWD, mb, c)
            start = time.perf_counter()
            chunk = self.chunks[c]
            quiet = index not in self._reduce_at and hasattr(chunk, "no_sync")
            with chunk.no_sync() if quiet else contextlib.nullcontext():
                torch.autograd.backward(out, grad_tensors=grad)
            if not first:
                g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                self._to_send(Action(SEND_BWD, mb, c), g)
        if self.timing:
            self._sync()
        end = time.perf_counter()
        self._busy += end - start
        if self.trace:
            self._trace.append((a, start - self._t0, end - self._t0))


def _len(x) -> str:
    return "none" if x is None else str(len(x))
