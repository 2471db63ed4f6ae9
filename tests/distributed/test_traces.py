"""``logging.profile`` and ``mtcore trace merge`` on a real 4-rank job: pp2 x dp2, 1F1B,
four micro-batches, steps 2-3 traced with torch.profiler (one spawn, real files).

Checked: one trace per rank with torch.profiler's events and mtcore's phases; every
forward/backward of every micro-batch in the schedule's order; stage 0's forward of a
micro-batch ends before stage 1's starts on the merged (barrier-aligned) clock; the
pipeline's receives and a data-parallel bucket reduction launched inside the last
backward (overlap); the memory counter; the merged timeline's rows; the summary's
categories adding up to the traced steps, with a bubble on stage 1; and the planned
trace of the same layout (``mtcore plan --trace``) with the same ranges in the same order.
"""

from __future__ import annotations

import gzip
import io
import json
import os

from mtcore.cli.main import main
from mtcore.parallel.pipeline import build_schedule
from mtcore.parallel.pipeline.schedules import COMPUTE
from mtcore.plan import load_hardware, plan
from mtcore.plan.trace import planned_trace
from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trace_format import ASYNC_TID, PHASES_TID
from mtcore.training.trace_merge import load, memory_peaks, merge, phases, summarize, trace_files
from mtcore.training.trainer import train

MICROBATCHES = 4


def _config(corpus, cache, traces) -> dict:
    return {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "parallel": dict(pp=2),
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(cache)),
        "training": dict(steps=3, global_batch_size=16, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": None},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines",
                        profile=dict(steps=[2, 3], memory=True, dir=str(traces))),
    }  # fmt: skip


def _rank_main(ctx, config: dict, rejoin: str):
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    stream = io.StringIO()
    train(validate(config), stream=stream)  # ends by destroying the process group
    ctx.backend.collective.init_process_group(
        rank=ctx.rank, world_size=ctx.world_size, init_method=f"file://{rejoin}"
    )
    return stream.getvalue()


def _computes(trace: dict, step: dict) -> list[tuple[str, int]]:
    inside = [
        e for e in phases(trace)
        if e["args"]["category"] == "compute" and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
    ]  # fmt: skip
    return [(e["name"].split()[0], e["args"]["microbatch"]) for e in inside]


def test_four_ranks_trace_merge_and_summary(tmp_path, write_code_corpus, capsys):
    corpus = write_code_corpus(tmp_path / "corpus", 12, 40)
    traces = tmp_path / "run" / "traces"
    config = _config(corpus, tmp_path / "cache", traces)
    validate(config)  # a wrong key fails here, not in four ranks
    outputs = run_ranks(_rank_main, 4, config, str(tmp_path / "rejoin"))
    assert "trace: steps 2-3 of the traced ranks" in outputs[0]

    files = trace_files(tmp_path / "run")
    assert [f.name for f in files] == [f"rank{r}.json.gz" for r in range(4)]
    loaded = [load(f) for f in files]
    # stage = rank // 2 (tp fastest, then dp, pp): ranks 0, 1 are stage 0.
    schedule = build_schedule("1f1b", 2, MICROBATCHES, 1)
    for rank, trace in enumerate(loaded):
        assert trace["mtcore"]["rank"] == rank and trace["mtcore"]["steps"] == [2, 3]
        torch_ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
        assert torch_ops, "torch.profiler's own events are in the trace"
        steps = [e for e in phases(trace) if e["args"]["category"] == "step"]
        assert [e["name"] for e in steps] == ["step 2", "step 3"]
        stage = rank // 2
        expected = [(a.kind, a.microbatch) for a in schedule.for_rank(stage) if a.kind in COMPUTE]
        for step in steps:
            assert _computes(trace, step) == expected
        names = {e["name"] for e in phases(trace)}
        assert {"optimizer", "data", "dp grad sync"} <= names
        assert any(n.startswith("recv_fwd" if stage else "recv_bwd") for n in names)
        memory = [e for e in trace["traceEvents"] if e.get("ph") == "C"]
        assert memory and all(e["args"]["bytes"] > 0 for e in memory)
        # dp2: a bucket's all-reduce is launched inside the last backward (overlap on)
        last_backward = [e for e in phases(trace) if e["name"].startswith("backward")][-1]
        reduces = [e for e in trace["traceEvents"] if e.get("tid") == ASYNC_TID and e.get("ph") == "X"]
        assert reduces and any(
            last_backward["ts"] <= r["ts"] < last_backward["ts"] + last_backward["dur"] for r in reduces
        )

    merged = merge(loaded)
    json.loads(json.dumps(merged))  # plain JSON
    rows = {e["pid"] for e in merged["traceEvents"] if e.get("ph") == "X"}
    assert rows == {0, 1, 2, 3}
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert set(names) == {0, 1, 2, 3} and names[2].startswith("rank 2")

    def ranges(rank: int, prefix: str) -> dict[int, dict]:
        return {
            e["args"]["microbatch"]: e for e in merged["traceEvents"]
            if e.get("pid") == rank and e.get("tid") == PHASES_TID and e.get("ph") == "X"
            and e["name"].startswith(prefix) and "microbatch" in e["args"]
        }  # fmt: skip (the last traced step's: later ones replace earlier)

    sent, received = ranges(0, "forward"), ranges(2, "forward")
    for mb in range(MICROBATCHES):  # stage 0 rank 0 feeds stage 1 rank 2 (same dp index)
        assert sent[mb]["ts"] + sent[mb]["dur"] <= received[mb]["ts"] + 100  # one host, one clock: 0.1 ms for the clock reads

    for trace in loaded:
        s = summarize(trace)
        assert s.steps == 2
        assert abs(sum(s.by_column.values()) - s.step_us) < 1e-6 * s.step_us + 1.0
        assert s.by_column["compute"] > 0 and min(s.by_column.values()) >= 0
    assert summarize(loaded[2]).by_column["bubble"] > 0  # stage 1 waits for stage 0's first forward

    # the planned trace of the same layout: the same ranges in the same order per stage
    planned = planned_trace(plan(validate(config), 4, load_hardware("cpu-host")))
    for stage in (0, 1):
        mine = [e["name"] for e in phases(planned, stage) if e["args"]["category"] == "compute"]
        last = next(e for e in phases(loaded[2 * stage]) if e["name"] == "step 3")
        measured = [
            e["name"] for e in phases(loaded[2 * stage])
            if e["args"]["category"] == "compute" and e["ts"] >= last["ts"]
        ]  # fmt: skip
        assert mine == measured

    for trace in loaded:  # memory: true
        peaks = memory_peaks(trace)
        assert peaks["forward"] > 0 and peaks["backward"] > 0 and peaks["optimizer"] > 0

    assert main(["trace", "merge", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "exposed comm" in out and "bubble" in out and out.count("rank ") >= 4
    assert out.count("peak memory by phase: ") == 4
    with gzip.open(traces / "merged.json.gz", "rt") as f:
        assert {e["pid"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}
