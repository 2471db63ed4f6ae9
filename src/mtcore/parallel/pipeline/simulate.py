"""Run a schedule on paper: check it cannot deadlock or mix up messages, and time it.

Every rank walks its action list as the runner does: a fused batch of comm
actions is posted without waiting; a compute action first waits for the
receive it needs; at the end the rank waits for its sends. Messages between
two ranks match in posting order, per channel, as in gloo and NCCL (no tags),
so the k-th send on a channel must be the counterpart of the k-th receive;
anything else would silently deliver the wrong tensor, and is an error here.

Modes (see ``simulate``) go from gloo's behaviour to NCCL's worst case. Compute takes ``forward``
or ``backward`` time units per micro-batch through one rank's whole share of
the model (a chunk takes 1/vpp of it); transfers take ``latency``. Where a
schedule splits the backward (zero bubble), ``weight`` of the ``backward`` time
is its W pass and the rest its B pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mtcore.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    RECV_BWD,
    RECV_FWD,
    SEND_FWD,
    WEIGHT,
    Action,
    Schedule,
    ScheduleError,
    counterpart,
    is_first_stage,
    is_last_stage,
    peer,
)


@dataclass
class Timeline:
    """Simulated start and end of every compute action, per rank."""

    schedule: Schedule
    compute: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float] = field(default_factory=list)

    def idle(self, rank: int) -> float:
        """Time rank ``rank`` does not compute between the common start and end."""
        return self.makespan - self.busy[rank]

    def idle_share(self, rank: int) -> float:
        return self.idle(rank) / self.makespan

    def gantt(self, unit: float = 1.0) -> str:
        """One line per rank, one character per ``unit`` of time (``.`` = idle)."""
        width = round(self.makespan / unit)
        lines = []
        for r, items in enumerate(self.compute):
            row = ["."] * width
            for a, start, end in items:
                letter = "abcdefghij"[a.microbatch % 10]
                mark = {FORWARD: str(a.microbatch % 10), WEIGHT: letter.upper()}.get(a.kind, letter)
                for i in range(round(start / unit), round(end / unit)):
                    row[i] = mark
            lines.append(f"rank {r}: " + "".join(row))
        legend = "(digits: forward of micro-batch n, letters: backward, capitals: weight)"
        return "\n".join(lines) + "\n" + legend


def channel_of(action: Action, split_directions: bool = True) -> str:
    """The group a transfer uses: activations on "fwd", gradients on "bwd".

    Two groups (the runner's policy) keep the two directions apart: with one
    group, interleaving deadlocks where a wait covers a whole call (a fused
    send of an activation holds up the receive of a gradient), and with
    pp == 2 both directions share the rank pair 0 -> 1.
    """
    if not split_directions:
        return "pp"
    return "fwd" if action.kind in (SEND_FWD, RECV_FWD) else "bwd"


@dataclass
class _Op:
    rank: int
    action: Action
    group: str
    call: int
    posted: float
    partner: _Op | None = None
    active: float | None = None
    done: float | None = None


MODES = ("async", "strict", "ordered")


def simulate(
    schedule: Schedule,
    forward: float = 1.0,
    backward: float = 2.0,
    latency: float = 0.0,
    mode: str = "async",
    split_directions: bool = True,
    cost: Callable[[int, Action], float] | None = None,
    weight: float | None = None,
) -> Timeline:
    """Simulate ``schedule``; raise ScheduleError on a deadlock or a message mix-up.

    mode "async": every op completes on its own once matched (gloo: one work
    per op). "strict": a wait covers the whole call it is in and a send needs
    the peer's receive posted. "ordered": strict, and the calls of one group
    on one rank run one after another (NCCL's one stream per communicator).
    ``cost(rank, action)``, when given, is the duration of each compute action
    (e.g. measured ones, to replay a real step without its transfer costs).
    ``weight``: the W share of ``backward`` where the schedule splits it (default half).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    pp, v = schedule.pp, schedule.vpp
    w_time = backward / 2 if weight is None else weight
    if not 0 <= w_time <= backward:
        raise ValueError(f"weight ({w_time}) must lie in [0, backward={backward}]")
    b_time = backward - w_time if schedule.splits_backward else backward
    durations = {FORWARD: forward, BACKWARD: b_time, WEIGHT: w_time}
    queues: dict[tuple, dict[str, list[_Op]]] = {}
    ops_of: list[list[_Op]] = [[] for _ in range(pp)]
    recv_of: list[dict[Action, _Op]] = [{} for _ in range(pp)]
    ptr, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    done = [False] * pp
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    calls = [0] * pp

    def post(r: int, batch: list[Action]) -> None:
        ids: dict[str, int] = {}
        for a in batch:
            group = channel_of(a, split_directions)
            call = ids.setdefault(group, calls[r] + len(ids))
            send = a.kind.startswith("send")
            other = peer(a, r, pp)
            lists = queues.setdefault((r, other, group) if send else (other, r, group), {True: [], False: []})
            op = _Op(r, a, group, call, clock[r])
            lists[send].append(op)
            ops_of[r].append(op)
            if not send:
                recv_of[r][a] = op
            index, theirs = len(lists[send]) - 1, lists[not send]
            if index < len(theirs):
                s, rv = (op, theirs[index]) if send else (theirs[index], op)
                want = counterpart(s.action, s.rank, pp)
                if want != rv.action:
                    raise ScheduleError(
                        f"message order mismatch on {group} channel {s.rank}->{rv.rank}: rank "
                        f"{s.rank} sends {s.action} (for {want}) as message {index}, but rank "
                        f"{rv.rank} receives {rv.action} there"
                    )
                s.partner, rv.partner = rv, s
        calls[r] += len(ids)
        resolve()

    def resolve() -> None:
        changed = True
        while changed:
            changed = False
            for ops in ops_of:
                for op in ops:
                    if op.active is None:
                        before = [o for o in ops if o.group == op.group and o.call < op.call]
                        if mode != "ordered" or not before:
                            op.active, changed = op.posted, True
                        elif all(o.done is not None for o in before):
                            op.active, changed = max(op.posted, *(o.done for o in before)), True
                    ready = op.partner is not None and op.partner.active is not None
                    if op.done is None and op.active is not None and ready:
                        op.done = op.partner.done = max(op.active, op.partner.active) + latency
                        changed = True

    def wait_for(r: int, ops: list[_Op]) -> float | None:
        if mode != "async":
            call_ids = {o.call for o in ops}
            ops = [o for o in ops_of[r] if o.call in call_ids]
        if any(o.done is None for o in ops):
            return None
        return max((o.done for o in ops), default=clock[r])

    def advance(r: int) -> bool:
        actions = schedule.actions[r]
        if ptr[r] == len(actions):
            t = wait_for(r, ops_of[r])
            if t is None:
                return False
            clock[r], done[r] = max(clock[r], t), True
            return True
        a = actions[ptr[r]]
        if not a.is_compute:
            end = ptr[r]
            while end < len(actions) and not actions[end].is_compute:
                end += 1
            post(r, list(actions[ptr[r] : end]))
            ptr[r] = end
            return True
        need = _needed(a, r, pp, v)
        start = clock[r]
        if need is not None:
            if need not in recv_of[r]:
                raise ScheduleError(f"rank {r}: {a} needs {need}, which was never posted before it")
            t = wait_for(r, [recv_of[r][need]])
            if t is None:
                return False
            start = max(start, t)
        dur = cost(r, a) if cost is not None else durations[a.kind] / v
        timeline[r].append((a, start, start + dur))
        clock[r], busy[r] = start + dur, busy[r] + dur
        ptr[r] += 1
        return True

    while not all(done):
        progressed = False
        for r in range(pp):
            while not done[r] and advance(r):
                progressed = True
        if not progressed:
            blocked = [
                f"rank {r} at {schedule.actions[r][ptr[r]] if ptr[r] < len(schedule.actions[r]) else 'end'}"
                for r in range(pp)
                if not done[r]
            ]
            raise ScheduleError(f"{schedule.name} deadlocks ({mode}): " + "; ".join(blocked))
    return Timeline(schedule, timeline, max(clock), busy)


def _needed(a: Action, rank: int, pp: int, vpp: int) -> Action | None:
    if a.kind == WEIGHT:  # its input came with its B
        return None
    if a.kind == FORWARD:
        return None if is_first_stage(rank, a.chunk) else Action(RECV_FWD, a.microbatch, a.chunk)
    if is_last_stage(rank, a.chunk, pp, vpp):
        return None
    return Action(RECV_BWD, a.microbatch, a.chunk)
