"""logging.profile's keys, ``mtcore train --profile``, the trace ranges' off and on paths,
and the summary's arithmetic on a hand-made trace (the 4-rank job is
tests/distributed/test_traces.py)."""

from __future__ import annotations

import pytest

from mtcore.backend import select_backend, tracing
from mtcore.cli.main import build_parser
from mtcore.training.config import ConfigError, TrainConfig
from mtcore.training.overrides import load_config
from mtcore.training.profiling import chrome_events
from mtcore.training.trace_format import PHASES_TID
from mtcore.training.trace_merge import COLUMNS, summarize


def test_profile_keys_and_their_checks():
    config = load_config(None, ["--logging.run_name", "r1", "--logging.profile.steps", "[3, 5]"])
    profile = config.logging.profile
    assert profile.steps == (3, 5) and profile.ranks == "all" and not profile.memory
    assert profile.dir == "runs/r1/traces"  # the run's own directory
    assert TrainConfig().logging.profile is None  # off unless asked for
    for bad in ("[0, 2]", "[4, 3]"):
        with pytest.raises(ConfigError, match="from <= to"):
            load_config(None, ["--logging.profile.steps", bad])
    config = load_config(None, ["--logging.profile", "{steps: [1, 1], ranks: [0, 7]}"])
    with pytest.raises(ValueError, match=r"ranks \[0, 7\]: the job has 4 ranks"):
        config.check(4)


def test_profile_flag_is_the_steps_override():
    parser = build_parser()
    assert parser.parse_args(["train", "c.yaml", "--profile"]).overrides == [
        "--logging.profile.steps", "[2, 3]"
    ]  # fmt: skip
    args = parser.parse_args(["train", "c.yaml", "--profile", "10:12", "--training.steps", "20"])
    assert args.overrides == ["--logging.profile.steps", "[10, 12]", "--training.steps", "20"]
    assert parser.parse_args(["train", "--profile=7", "c.yaml"]).config == "c.yaml"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "c.yaml", "--profile=a:b"])


def test_ranges_are_one_null_context_when_off_and_nested_when_on():
    assert not tracing.recording()
    first = tracing.phase("forward", "compute", microbatch=0, chunk=0)
    assert first is tracing.phase("optimizer", "optimizer")  # one shared object: no work
    assert tracing.begin("dp all-reduce") is None
    device = select_backend("cpu").device
    recorder = tracing.PhaseRecorder(device, memory=True)
    recorder.start()
    try:
        with tracing.phase("step 1", "step"):
            with (
                tracing.phase("forward", "compute", microbatch=2, chunk=1),
                tracing.phase("zero3 gather", "comm"),
            ):
                pass
            inflight = tracing.begin("dp all-reduce bucket 0", bucket=0)
            tracing.end(inflight)
    finally:
        recorder.stop()
    assert not tracing.recording()
    names = [e.name for e in recorder.events]
    assert names == ["zero3 gather", "forward mb2 c1", "dp all-reduce bucket 0", "step 1"]
    assert all(e.end_ns >= e.start_ns for e in recorder.events)
    assert len(recorder.samples) == 3 and all(v > 0 for _, v in recorder.samples)  # the RSS
    events = chrome_events(recorder, pid=1, base_ns=0)
    assert {e["ph"] for e in events} >= {"M", "X", "C"}


def _x(name, category, ts, dur):
    return {"ph": "X", "name": name, "tid": PHASES_TID, "ts": ts, "dur": dur, "pid": 0,
            "args": {"category": category}}  # fmt: skip


def test_summary_counts_each_moment_once_for_the_innermost_phase():
    trace = {
        "mtcore": {"rank": 3},
        "traceEvents": [
            _x("barrier", "comm", 0, 5),  # before the first step: not counted
            _x("step 2", "step", 10, 100),
            _x("data", "data", 12, 3),
            _x("forward mb0 c0", "compute", 20, 40),
            _x("zero3 gather", "comm", 25, 10),  # inside the forward: exposed comm
            _x("recv_bwd mb0 c0", "bubble", 60, 20),
            _x("optimizer", "optimizer", 85, 20),
        ],
    }
    s = summarize(trace)
    assert s.rank == 3 and s.steps == 1 and s.step_us == 100
    assert s.by_column == {"compute": 30, "exposed comm": 10, "bubble": 20, "optimizer": 20,
                           "data": 3, "other": 17}  # fmt: skip
    assert set(s.by_column) == set(COLUMNS.values())


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bucket_reduction_overlaps_the_backward_only_with_overlap_on(overlap):
    """The in-flight range of each dp bucket starts inside the backward when buckets are
    launched from it, and after it (in finish_grad_sync) when overlap is off."""
    import torch
    from torch import nn

    from mtcore.parallel.data import DataParallel, DataParallelConfig
    from mtcore.parallel.layout import ParallelLayout

    backend = select_backend("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    config = DataParallelConfig(bucket_size=40, overlap_grad_reduce=overlap)
    ddp = DataParallel(model, ParallelLayout.single(), backend, config)
    recorder = tracing.PhaseRecorder(backend.device)
    recorder.start()
    try:
        with tracing.phase("backward", "compute", microbatch=0, chunk=0):
            ddp(torch.randn(5, 6)).square().mean().backward()
        with tracing.phase("dp grad sync", "comm"):
            ddp.finish_grad_sync()
    finally:
        recorder.stop()
    backward = next(e for e in recorder.events if e.name.startswith("backward"))
    reductions = [e for e in recorder.events if e.track == tracing.ASYNC]
    assert [e.args["bucket"] for e in reductions] == [0, 1]
    inside = [backward.start_ns <= e.start_ns <= backward.end_ns for e in reductions]
    assert inside == [overlap, overlap]
    assert all(e.end_ns >= e.start_ns for e in reductions)
