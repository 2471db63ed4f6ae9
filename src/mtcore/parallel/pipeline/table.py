"""The pipeline schedule table: one entry per schedule, read by everything that names one.

The config's ``parallel.schedule`` check, the engine (``build_schedule``), the planner's
memory model (micro-batches held per stage), its time model (the bubble) and the layout
search (which form a vpp runs) all read ``SCHEDULE_TABLE``. Adding a schedule is one
``ScheduleEntry`` plus its builder (a function returning a ``Schedule``: each rank's
compute order through ``schedules.with_transfers``), passed to ``register_schedule``.

An entry's formulas are the closed forms of what its builder's action lists do;
``tests/unit/plan/test_memory_formulas.py`` checks them against ``Schedule.max_in_flight``.
Arithmetic only: imported without torch (``mtcore plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from mtcore.parallel.pipeline import schedules
from mtcore.parallel.pipeline.schedules import Schedule, ScheduleError

# (per-stage seconds of one micro-batch, each stage's weight-gradient share, the
# slowest stage, vpp) -> seconds of a step no stage computes
Bubble = Callable[[Sequence[float], Sequence[float], int, int], float]


@dataclass(frozen=True)
class ScheduleEntry:
    """One pipeline schedule.

    build: ``(pp, vpp, microbatches) -> Schedule``. chunks: the virtual-stage rule, how
    many chunks per rank it runs: ``one`` (vpp 1), ``several`` (vpp > 1) or ``any``.
    in_flight: ``(pp, vpp, rank, microbatches)`` -> micro-batches' worth of the rank's
    layers whose activations are held at once (pp > 1). heads_in_flight: ``(pp, vpp,
    microbatches)`` -> micro-batches whose loss the last stage holds (pp > 1). bubble:
    see ``Bubble`` (pp > 1). splits_weight: its backward is split into B and W (zero
    bubble). other_form: the same schedule for the other chunk count (the search and
    the config's hint use it). pipelined: False for the one-stage schedule the engine
    runs at pp 1, which a config does not name.
    """

    name: str
    build: Callable[[int, int, int], Schedule]
    chunks: Literal["one", "several", "any"]
    in_flight: Callable[[int, int, int, int], float]
    heads_in_flight: Callable[[int, int, int], int]
    bubble: Bubble
    splits_weight: bool = False
    other_form: str | None = None
    pipelined: bool = True

    def fits(self, vpp: int) -> bool:
        """Whether it runs ``vpp`` chunks per rank."""
        return self.chunks == "any" or (self.chunks == "several") == (vpp > 1)


SCHEDULE_TABLE: dict[str, ScheduleEntry] = {}
DEFAULT_SCHEDULE = "1f1b"


def register_schedule(entry: ScheduleEntry) -> ScheduleEntry:
    """Add ``entry`` to the table (a name already there is an error)."""
    if entry.name in SCHEDULE_TABLE:
        raise ScheduleError(f"schedule {entry.name!r} is registered already")
    SCHEDULE_TABLE[entry.name] = entry
    return entry


def schedule_entry(name: str) -> ScheduleEntry:
    try:
        return SCHEDULE_TABLE[name]
    except KeyError:
        known = ", ".join(SCHEDULE_TABLE)
        raise ScheduleError(f"unknown schedule {name!r}; known: {known}") from None


def configurable_schedules() -> list[str]:
    """The names ``parallel.schedule`` takes (every pipelined schedule)."""
    return [name for name, entry in SCHEDULE_TABLE.items() if entry.pipelined]


def check_virtual_stages(name: str, vpp: int) -> ScheduleEntry:
    """The entry of ``name`` if it runs ``vpp`` chunks per rank, else a one-line error."""
    entry = schedule_entry(name)
    if entry.fits(vpp):
        return entry
    if entry.chunks == "several":
        raise ScheduleError(
            f"schedule {name} needs vpp > 1 (chunks per pipeline rank); got vpp={vpp}"
        )
    if entry.other_form is not None:
        raise ScheduleError(
            f"schedule {name} runs one chunk per rank (vpp=1); got vpp={vpp}; "
            f"use {entry.other_form}"
        )
    raise ScheduleError(
        f"schedule {name} has no interleaved form (got vpp={vpp}); "
        f"use {DEFAULT_SCHEDULE} with vpp > 1"
    )


def form_for(name: str, vpp: int) -> str:
    """The asked schedule in the form ``vpp`` runs (its ``other_form``), or the default
    where it has none (GPipe has no interleaved form)."""
    entry = schedule_entry(name)
    if entry.fits(vpp):
        return name
    return entry.other_form if entry.other_form is not None else DEFAULT_SCHEDULE


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """The action lists of schedule ``name`` ("1f1b" with vpp > 1 is the interleaved one)."""
    return check_virtual_stages(name, vpp).build(pp, vpp, microbatches)


# -- the closed forms --------------------------------------------------------------------
def _interleaved_in_flight(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """``2 (p - r - 1) + (v - 1) p + 1`` chunks in flight, each 1/v of the rank's layers:
    on stage 0, ``p (1 + (p - 1) / (p v))`` micro-batches' worth (Korthikanti et al. 2022,
    sec. 4.2.3). With as many micro-batches as stages every forward runs before the first
    backward (as Megatron-Core's), so every rank holds all of them."""
    if microbatches == pp:
        return float(microbatches)
    return min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, microbatches * vpp) / vpp


def _interleaved_heads(pp: int, vpp: int, microbatches: int) -> int:
    """One, but every micro-batch where the interleaved order runs all forwards first."""
    return microbatches if vpp > 1 and microbatches == pp else 1


def drain_bubble(per_stage: Sequence[float], weight_grads: Sequence[float], slow: int,
                 vpp: int) -> float:  # fmt: skip
    """The pipeline fills and drains through every stage once: the sum of the stages'
    micro-batch times less the slowest's, which the micro-batches pay; equal stages give
    the familiar (p - 1)(F + B + W). Interleaving divides it by v."""
    return (sum(per_stage) - per_stage[slow]) / vpp


def weight_filled_bubble(per_stage: Sequence[float], weight_grads: Sequence[float], slow: int,
                         vpp: int) -> float:  # fmt: skip
    """W passes fill the drain: each stage adds F + B - W (Qi et al. 2023), its time less
    twice its weight-gradient share; divided by v when interleaved."""
    filled = [max(0.0, t - 2 * w) for t, w in zip(per_stage, weight_grads, strict=True)]
    return (sum(filled) - filled[slow]) / vpp


def _one_stage(pp: int, vpp: int, microbatches: int) -> Schedule:
    if pp != 1 or vpp != 1:
        raise ScheduleError(f"no_pipelining runs one stage; got pp={pp}, vpp={vpp}")
    return schedules.no_pipelining(microbatches)


def _gpipe(pp: int, vpp: int, microbatches: int) -> Schedule:
    return schedules.gpipe(pp, microbatches)


def _one_f_one_b(pp: int, vpp: int, microbatches: int) -> Schedule:
    if vpp == 1:
        return schedules.one_f_one_b(pp, microbatches)
    return schedules.interleaved_1f1b(pp, vpp, microbatches)


def _zb_h1(pp: int, vpp: int, microbatches: int) -> Schedule:
    return schedules.zb_h1(pp, microbatches)


def _one_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    return 1.0


def _all_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """GPipe: every micro-batch in flight at once."""
    return float(microbatches)


def _one_f_one_b_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """1F1B: stage r holds ``p - r`` micro-batches after warm-up (stage 0 the most)."""
    if vpp > 1:
        return _interleaved_in_flight(pp, vpp, rank, microbatches)
    return float(min(pp - rank, microbatches))


def _zb_h1_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """ZB-H1: stage r holds back r W passes (their inputs and output gradients), so every
    stage holds up to stage 0's ``p``; counted as whole micro-batches, an upper bound."""
    return float(min(pp, microbatches))


def _interleaved_zb_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """Rank r holds r chunks more than under interleaving: up to rank 0's count."""
    return _interleaved_in_flight(pp, vpp, 0, microbatches)


def _one_head(pp: int, vpp: int, microbatches: int) -> int:
    return 1


def _all_heads(pp: int, vpp: int, microbatches: int) -> int:
    return microbatches


def _no_bubble(per_stage: Sequence[float], weight_grads: Sequence[float], slow: int,
               vpp: int) -> float:  # fmt: skip
    return 0.0


for _entry in (
    ScheduleEntry("no_pipelining", _one_stage, "one", _one_held, _one_head, _no_bubble,
                  pipelined=False),
    ScheduleEntry("gpipe", _gpipe, "one", _all_held, _all_heads, drain_bubble),
    ScheduleEntry("1f1b", _one_f_one_b, "any", _one_f_one_b_held, _interleaved_heads,
                  drain_bubble, other_form="interleaved_1f1b"),
    ScheduleEntry("interleaved_1f1b", schedules.interleaved_1f1b, "several", _interleaved_in_flight,
                  _interleaved_heads, drain_bubble, other_form="1f1b"),
    ScheduleEntry("zb_h1", _zb_h1, "one", _zb_h1_held, _one_head, weight_filled_bubble,
                  splits_weight=True, other_form="interleaved_zb"),
    ScheduleEntry("interleaved_zb", schedules.interleaved_zb, "several", _interleaved_zb_held,
                  _interleaved_heads, weight_filled_bubble, splits_weight=True,
                  other_form="zb_h1"),
):  # fmt: skip
    register_schedule(_entry)
