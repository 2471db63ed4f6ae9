"""``mtcore plan CONFIG --trace FILE``: the planned step in logging.profile's format, its
ranges in the schedule's order, its categories adding up to the planner's step; the
per-category means ``mtcore sweep --trace`` prints beside the measured ones."""

from __future__ import annotations

import gzip
import json

import pytest

from mtcore.cli.main import main
from mtcore.parallel.pipeline import build_schedule
from mtcore.parallel.pipeline.schedules import COMPUTE
from mtcore.plan import load_hardware, plan
from mtcore.plan.trace import category_ms, format_categories, planned_trace, rows_of, save
from mtcore.training.overrides import load_config
from mtcore.training.trace_merge import load, phases, summarize

HOST = load_hardware("cpu-host")


def _order(trace, stage):
    found = [e for e in phases(trace, stage) if e["args"]["category"] == "compute"]
    return [(e["name"].split()[0], e["args"]["microbatch"], e["args"]["chunk"]) for e in found]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_planned_ranges_follow_the_schedule_and_add_up(schedule):
    config = load_config("configs/default.yaml", ["--parallel.schedule", schedule])
    result = plan(config, 4, HOST)
    trace = planned_trace(result)
    m = result.microbatches
    expected = build_schedule(schedule, 2, m, 1)
    for stage in (0, 1):
        want = [(a.kind, a.microbatch, a.chunk) for a in expected.for_rank(stage) if a.kind in COMPUTE]
        assert _order(trace, stage) == want
        s = summarize(trace, pid=stage)
        assert s.steps == 1
        assert sum(s.by_column.values()) == pytest.approx(s.step_us, rel=1e-9)
        assert s.by_column["compute"] > 0 and s.by_column["optimizer"] > 0
    kinds = {k for k, _, _ in _order(trace, 0)}
    assert ("weight" in kinds) == (schedule == "zb_h1")  # W apart from B under zero bubble
    # the simulated step is the planner's: the same bubble formula for equal stages' sum
    assert trace["mtcore"]["step_s"] == pytest.approx(result.time.total, rel=0.15)
    assert summarize(trace, pid=0).by_column["bubble"] > 0  # stage 0 waits for gradients


def test_plan_trace_flag_writes_the_file_and_the_summary(tmp_path, capsys):
    out = tmp_path / "planned.json.gz"
    args = ["plan", "configs/default.yaml", "--gpus", "4", "--hardware", "cpu-host"]
    assert main([*args, "--trace", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "planned trace:" in printed and "stage   1" in printed and "exposed comm" in printed
    with gzip.open(out, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_category_means_and_the_measured_over_planned_table(tmp_path):
    """``mtcore sweep --trace``'s table: each column the mean over a trace's rows (its
    stages here) of ms per step, the columns adding up to the step; the trace saved and
    read back gives the same numbers."""
    trace = planned_trace(plan(load_config("configs/default.yaml", []), 4, HOST))
    assert rows_of(trace) == [0, 1]
    ms = category_ms(trace)
    stages = [summarize(trace, pid=stage) for stage in (0, 1)]
    assert ms["compute"] == pytest.approx(sum(s.by_column["compute"] for s in stages) / 2e3)
    assert ms["step"] == pytest.approx(sum(v for k, v in ms.items() if k != "step"))
    save(trace, tmp_path / "deep" / "planned.json.gz")
    assert category_ms(load(tmp_path / "deep" / "planned.json.gz")) == ms
    table = format_categories([("tp=2,pp=2", ms, ms)]).splitlines()
    assert table[0].split() == ["layout", "step", "compute", "exposed", "comm", "bubble",
                                "optimizer", "data", "other"]  # fmt: skip
    assert table[1].startswith("tp=2,pp=2") and f"{ms['bubble']:7.1f} /{ms['bubble']:6.1f}" in table[1]
