"""Pipeline schedules as data: one list of actions per pipeline rank.

A schedule is built from each rank's *compute order*, a list of units of one
or two compute actions (forward / backward of a (micro-batch, chunk)); the
transfers are derived from it by one rule, Megatron-Core's: between two units
a rank posts, as one batch, the sends of what the first unit produced and the
receives of what the second needs. With one-action units in 1F1B that is
Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``;
interleaving uses (forward, backward) units, as Megatron's
``send_forward_backward_recv_forward_backward``. Consecutive comm actions in
a list *are* such a fused batch; the runner posts them together.
``mtcore.parallel.pipeline.simulate`` checks any list for deadlocks and
message mix-ups, from gloo's semantics to NCCL's worst case.

Virtual stages are chunk-major (Megatron interleaving): chunk ``c`` of rank
``r`` is virtual stage ``c * pp + r``. So activations always go to rank
``r + 1 mod pp`` and gradients to ``r - 1 mod pp``; only the first virtual
stage takes the micro-batch input and only the last computes the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "forward", "backward", "weight"
SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD = "send_fwd", "recv_fwd", "send_bwd", "recv_bwd"
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
COMM = (SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD)
KINDS = COMPUTE + COMM
_CODE = {
    FORWARD: "F",
    BACKWARD: "B",
    WEIGHT: "W",
    SEND_FWD: "sF",
    RECV_FWD: "rF",
    SEND_BWD: "sB",
    RECV_BWD: "rB",
}


class ScheduleError(ValueError):
    """A schedule that cannot be built or cannot run (naming the numbers)."""


@dataclass(frozen=True)
class Action:
    """One step of a rank: compute (``forward``/``backward``/``weight``) or one transfer.

    In a schedule with ``weight`` actions (zero bubble), ``backward`` computes only
    the input gradients (B) and ``weight`` the deferred weight gradients (W) of the
    same (micro-batch, chunk); elsewhere ``backward`` computes both.

    ``microbatch`` and ``chunk`` name the tensor: for a transfer, the
    (micro-batch, chunk) *on this rank* whose activation or gradient moves.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def label(self, chunks: bool = False) -> str:
        text = f"{_CODE[self.kind]}{self.microbatch}"
        return f"{text}.{self.chunk}" if chunks else text

    def __str__(self) -> str:
        return self.label(chunks=True)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one pipeline schedule (``actions[rank]``)."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def compute_order(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def steps(self, rank: int) -> list[tuple[tuple[Action, ...], Action | None]]:
        """The rank's list as (fused comm batch before, compute) pairs; the
        last pair holds the trailing batch and ``None``."""
        out, batch = [], []
        for a in self.actions[rank]:
            if a.is_compute:
                out.append((tuple(batch), a))
                batch = []
            else:
                batch.append(a)
        if batch:
            out.append((tuple(batch), None))
        return out

    @property
    def splits_backward(self) -> bool:
        """Whether backward is split into B (input gradients) and W (weight gradients)."""
        return any(a.kind == WEIGHT for actions in self.actions for a in actions)

    def max_in_flight(self, rank: int) -> int:
        """Most (micro-batch, chunk) forwards whose backward has not run yet (with
        the backward split, whose W has not run: W still holds what it needs)."""
        release = WEIGHT if self.splits_backward else BACKWARD
        live = peak = 0
        for a in self.compute_order(rank):
            live += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
            peak = max(peak, live)
        return peak

    def delivered_by(self, rank: int) -> dict[Action, tuple[Action, ...]]:
        """For each receive of ``rank``, the rank's sends it proves delivered.

        A send is delivered once its peer has waited for the matching receive, which
        the peer does before the compute that consumes it. A message the same peer
        posts after that compute therefore arrives only after the send was delivered:
        once ``rank`` has received it, waiting on the send cannot block. This is what
        lets a runner drop sent tensors during the step on a library whose send
        handles report completion only when waited for (gloo), without the risk of
        waiting on a send whose receive is not posted yet.
        """
        mine = self.actions[rank]
        position = {p: {a: i for i, a in enumerate(self.actions[p])} for p in range(self.pp)}
        out: dict[Action, list[Action]] = {}
        for index, send in enumerate(mine):
            if send.kind not in (SEND_FWD, SEND_BWD):
                continue
            other = peer(send, rank, self.pp)
            receive = counterpart(send, rank, self.pp)
            kind = FORWARD if receive.kind == RECV_FWD else BACKWARD
            consumed = position[other][Action(kind, receive.microbatch, receive.chunk)]
            for later in mine[index + 1 :]:
                if later.kind not in (RECV_FWD, RECV_BWD) or peer(later, rank, self.pp) != other:
                    continue
                if position[other][counterpart(later, rank, self.pp)] > consumed:
                    out.setdefault(later, []).append(send)
                    break
        return {receive: tuple(sends) for receive, sends in out.items()}

    def table(self) -> str:
        """A readable table: one row per compute step, one column per rank;
        a cell shows the fused batch posted before the compute, then the compute."""
        chunks = self.vpp > 1
        cols = []
        for r in range(self.pp):
            cells = []
            for batch, compute in self.steps(r):
                comm = " ".join(a.label(chunks) for a in batch)
                text = f"[{comm}] " if comm else ""
                cells.append(text + (compute.label(chunks) if compute else ""))
            cols.append(cells)
        rows = max(len(c) for c in cols)
        width = max(8, *(len(x) for c in cols for x in c))
        head = f"{self.name}: pp={self.pp} vpp={self.vpp} microbatches={self.microbatches}"
        lines = [head, "step | " + " | ".join(f"rank {r}".ljust(width) for r in range(self.pp))]
        lines.append("-" * len(lines[1]))
        for i in range(rows):
            cells = [(c[i] if i < len(c) else "").ljust(width) for c in cols]
            lines.append(f"{i:4d} | " + " | ".join(cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# -- compute orders ------------------------------------------------------------------
def _check(pp: int, m: int, vpp: int = 1) -> None:
    if pp < 1 or m < 1 or vpp < 1:
        raise ScheduleError(f"need pp >= 1, microbatches >= 1, vpp >= 1; got pp={pp}, m={m}, vpp={vpp}")


def no_pipelining(microbatches: int) -> Schedule:
    """One stage, gradient accumulation: F0 B0 F1 B1 ..."""
    _check(1, microbatches)
    order = [(Action(FORWARD, i), Action(BACKWARD, i)) for i in range(microbatches)]
    return with_transfers("no_pipelining", [order], 1, 1, microbatches)


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (every micro-batch in flight at once)."""
    _check(pp, microbatches)
    order = [(Action(FORWARD, i),) for i in range(microbatches)]
    order += [(Action(BACKWARD, i),) for i in range(microbatches)]
    return with_transfers("gpipe", [list(order) for _ in range(pp)], pp, 1, microbatches)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs min(pp - r - 1, m) warmup forwards,
    then alternates one forward and one backward, then drains the backwards.
    At most pp micro-batches are in flight on rank 0."""
    _check(pp, microbatches)
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        order = [(Action(FORWARD, i),) for i in range(warmup)]
        for i in range(microbatches - warmup):
            order += [(Action(FORWARD, warmup + i),), (Action(BACKWARD, i),)]
        order += [(Action(BACKWARD, i),) for i in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return with_transfers("1f1b", orders, pp, 1, microbatches)


def interleaved_1f1b(pp: int, vpp: int, microbatches: int) -> Schedule:
    """Interleaved 1F1B with ``vpp`` chunks per rank, in Megatron-Core's order.

    The k-th forward of any rank runs micro-batch ``(k // (pp*v)) * pp + k % pp``
    on chunk ``(k % (pp*v)) // pp``; backwards go through the chunks in reverse.
    Warmup: ``2 (pp - r - 1) + (v - 1) pp`` forwards (all of them when m == pp).
    """
    units = _interleaved_units(pp, vpp, microbatches)
    return with_transfers("interleaved_1f1b", units, pp, vpp, microbatches)


def interleaved_zb(pp: int, vpp: int, microbatches: int) -> Schedule:
    """Interleaved 1F1B with the backward split as in ZB-H1: rank r holds back each
    W by r backwards and runs it at the start of a later unit, after the unit's fused
    transfers went out, so a B's gradient never waits for a W. Idle with equal F, B, W:
    (p - 1)(F + B - W) / v against interleaving's (p - 1)(F + B + W) / v; rank r holds
    r more chunks than under interleaving, rank 0's peak at most."""
    units = _interleaved_units(pp, vpp, microbatches)
    orders = []
    for r, order in enumerate(units):
        out, held, due = [], [], ()
        for unit in order:
            out.append(due + unit)
            held += [Action(WEIGHT, a.microbatch, a.chunk) for a in unit if a.kind == BACKWARD]
            due, held = tuple(held[: max(0, len(held) - r)]), held[max(0, len(held) - r) :]
        if due or held:
            out.append(due + tuple(held))
        orders.append(out)
    return with_transfers("interleaved_zb", orders, pp, vpp, microbatches)


def _interleaved_units(pp: int, vpp: int, microbatches: int) -> list[list[tuple[Action, ...]]]:
    """Each rank's compute units under interleaved 1F1B (see ``interleaved_1f1b``)."""
    _check(pp, microbatches, vpp)
    if pp < 2:
        raise ScheduleError(f"interleaving needs pp >= 2 (got pp={pp}); use 1f1b or no_pipelining")
    if microbatches % pp:
        raise ScheduleError(
            f"interleaved 1F1B needs the number of micro-batches ({microbatches}) to be a "
            f"multiple of pp ({pp})"
        )
    total, group = microbatches * vpp, pp * vpp

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % group) // pp
        return (k // group) * pp + k % pp, chunk if forward else vpp - 1 - chunk

    orders = []
    for r in range(pp):
        warmup = total if microbatches == pp else min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
        order = [(Action(FORWARD, *unit(k, True)),) for k in range(warmup)]
        for k in range(total - warmup):
            # One unit: as Megatron, send F's output only after B, with B's
            # gradient. Sending it in between deadlocks where a wait covers a
            # whole fused call or a group's calls complete in order (NCCL):
            # simulate modes "strict" / "ordered", tests/unit/pipeline.
            order += [(Action(FORWARD, *unit(k + warmup, True)), Action(BACKWARD, *unit(k, False)))]
        order += [(Action(BACKWARD, *unit(k, False)),) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each
    backward split into B (input gradients, sent upstream at once) and W (weight
    gradients, which nothing waits for).

    Rank r runs 1F1B's forwards and B's and holds back its W's by r micro-batches:
    the k-th B is followed by the W of micro-batch k - r, and the r W's left over
    fill the drain, where 1F1B waits for gradients. A micro-batch is held from its
    F to its W, so rank r holds at most (pp - r) + r = pp of them: rank 0's 1F1B
    peak, on every rank. With F, B and W of equal time the bubble shrinks from
    1F1B's (pp - 1)(F + B + W) to (pp - 1)(F + B - W).
    """
    _check(pp, microbatches)
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        order = [(Action(FORWARD, i),) for i in range(warmup)]
        weights = iter(range(microbatches))
        for k in range(microbatches):
            if k + warmup < microbatches:
                order.append((Action(FORWARD, k + warmup),))
            order.append((Action(BACKWARD, k),))
            if k >= r:
                order.append((Action(WEIGHT, next(weights)),))
        order += [(Action(WEIGHT, i),) for i in weights]
        orders.append(order)
    return with_transfers("zb_h1", orders, pp, 1, microbatches)


# -- transfers -------------------------------------------------------------------------
def is_first_stage(rank: int, chunk: int) -> bool:
    return rank == 0 and chunk == 0


def is_last_stage(rank: int, chunk: int, pp: int, vpp: int) -> bool:
    return rank == pp - 1 and chunk == vpp - 1


def with_transfers(name: str, orders: Sequence[Sequence[tuple[Action, ...]]], pp: int, vpp: int, m: int) -> Schedule:
    """The schedule whose ranks run ``orders`` (each rank's compute units), with the
    transfers derived from them by the rule above: what a new schedule's builder returns."""
    lists = []
    for r, order in enumerate(orders):

        def recv(a: Action, r=r) -> list[Action]:
            if a.kind == FORWARD and not is_first_stage(r, a.chunk):
                return [Action(RECV_FWD, a.microbatch, a.chunk)]
            if a.kind == BACKWARD and not is_last_stage(r, a.chunk, pp, vpp):
                return [Action(RECV_BWD, a.microbatch, a.chunk)]
            return []

        def send(a: Action, r=r) -> list[Action]:
            if a.kind == FORWARD and not is_last_stage(r, a.chunk, pp, vpp):
                return [Action(SEND_FWD, a.microbatch, a.chunk)]
            if a.kind == BACKWARD and not is_first_stage(r, a.chunk):
                return [Action(SEND_BWD, a.microbatch, a.chunk)]
            return []

        out: list[Action] = []
        previous: tuple[Action, ...] = ()
        for unit in order:
            out += [x for a in previous for x in send(a)]
            out += [x for a in unit for x in recv(a)]
            out += unit
            previous = unit
        out += [x for a in previous for x in send(a)]
        lists.append(tuple(out))
    return Schedule(name, pp, vpp, m, tuple(lists))


def peer(action: Action, rank: int, pp: int) -> int:
    """The pipeline rank (index in the pp group) a transfer goes to or comes from."""
    if action.kind in (SEND_FWD, RECV_BWD):
        return (rank + 1) % pp
    if action.kind in (RECV_FWD, SEND_BWD):
        return (rank - 1) % pp
    raise ValueError(f"{action} is not a transfer")


def counterpart(action: Action, rank: int, pp: int) -> Action:
    """The action on ``peer(action)`` that matches this transfer."""
    step = 1 if action.kind in (SEND_FWD, RECV_BWD) else -1
    other = rank + step
    chunk = action.chunk + (1 if other == pp else -1 if other == -1 else 0)
    return Action(_OPPOSITE[action.kind], action.microbatch, chunk)


_OPPOSITE = {SEND_FWD: RECV_FWD, RECV_FWD: SEND_FWD, SEND_BWD: RECV_BWD, RECV_BWD: SEND_BWD}
