"""Adding a pipeline schedule is one table entry plus its builder: a toy schedule
registered here is taken by the config, planned by the planner and run by the simulator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mtcore.parallel.pipeline import (
    SCHEDULE_TABLE,
    Action,
    ScheduleEntry,
    build_schedule,
    register_schedule,
    simulate,
    with_transfers,
)
from mtcore.parallel.pipeline.schedules import BACKWARD, FORWARD, ScheduleError
from mtcore.parallel.pipeline.table import drain_bubble, form_for
from mtcore.plan import load_hardware, plan
from mtcore.training.config import TrainConfig

TOY = "gpipe_lifo"


def gpipe_lifo(pp: int, vpp: int, microbatches: int):
    """GPipe with the backwards in reverse: the last micro-batch forwarded goes back first."""
    order = [(Action(FORWARD, i),) for i in range(microbatches)]
    order += [(Action(BACKWARD, i),) for i in reversed(range(microbatches))]
    return with_transfers(TOY, [list(order) for _ in range(pp)], pp, 1, microbatches)


def _all_held(pp: int, vpp: int, rank: int, microbatches: int) -> float:
    return float(microbatches)


def _all_heads(pp: int, vpp: int, microbatches: int) -> int:
    return microbatches


@pytest.fixture
def toy():
    entry = register_schedule(
        ScheduleEntry(TOY, gpipe_lifo, "one", _all_held, _all_heads, drain_bubble)
    )
    yield entry
    del SCHEDULE_TABLE[TOY]


def config(schedule: str, vpp: int = 1):
    return TrainConfig.model_validate(
        {
            "model": {"family": "gpt", "style": "llama", "hidden_size": 1024, "num_layers": 8,
                      "num_heads": 16, "seq_len": 1024, "vocab_size": 32768},
            "parallel": {"pp": 4, "vpp": vpp, "schedule": schedule},
            "precision": {"dtype": "bf16"},
            "training": {"global_batch_size": 16, "micro_batch_size": 1},
        }
    )  # fmt: skip


def test_an_unregistered_schedule_is_refused_in_one_line():
    with pytest.raises(ValidationError, match=f"unknown schedule '{TOY}'; known: .*zb_h1"):
        config(TOY)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule(TOY, 2, 4)


def test_a_registered_schedule_is_configured_planned_and_simulated(toy):
    assert config(TOY).parallel.schedule == TOY
    with pytest.raises(ValidationError, match=f"schedule {TOY} has no interleaved form"):
        config(TOY, vpp=2)
    with pytest.raises(ScheduleError, match="registered already"):
        register_schedule(toy)
    assert form_for(TOY, 1) == TOY and form_for(TOY, 2) == "1f1b"  # what the search runs

    # the planner: memory from the entry's in-flight count, time from its bubble
    a100 = load_hardware("A100-80GB")
    planned, one_f_one_b = plan(config(TOY), 4, a100), plan(config("1f1b"), 4, a100)
    assert [rank.in_flight for rank in planned.ranks] == [16] * 4
    assert [rank.in_flight for rank in one_f_one_b.ranks] == [4, 3, 2, 1]
    assert planned.time.bubble == pytest.approx(one_f_one_b.time.bubble)  # both drain once
    assert planned.peak_memory > one_f_one_b.peak_memory

    # the simulator runs its action lists, which hold what the entry says
    schedule = build_schedule(TOY, 4, 8)
    assert schedule.name == TOY and not schedule.splits_backward
    for rank in range(4):
        assert schedule.max_in_flight(rank) == toy.in_flight(4, 1, rank, 8) == 8
    timeline = simulate(schedule, forward=1.0, backward=2.0)
    assert timeline.idle(0) == toy.bubble([3.0] * 4, [0.0] * 4, 0, 1) == 9.0
    assert timeline.gantt().splitlines()[3].startswith("rank 3: ...01234567hhggffeedd")  # last in, first out
