"""The planned step as a trace: ``mtcore plan CONFIG --trace FILE``.

The schedule simulator (``mtcore.parallel.pipeline.simulate``) walks each pipeline
rank's action list with the planner's predicted durations: a micro-batch's time on a
stage (``Plan.stage_seconds``: compute, recompute, element-wise work and the tp, cp, ep
and pp communication the planner counts as exposed) split a third to the forward and
two thirds to the backward (the planner's own split), the weight-gradient share
(``Plan.weight_seconds``) as W where the schedule splits the backward. The result is
written in the format ``logging.profile`` writes, one process row per stage, with the
same phase names and categories, so the planned and the measured timelines open side by
side and ``mtcore.training.trace_merge.summarize`` reads both:

* each compute action is a ``forward``/``backward``/``weight`` range (``compute``) with
  a ``planned comm`` range (``comm``) inside it at its end: the predicted exposed tp,
  cp, ep and pp time of that micro-batch;
* a compute action that starts later than its rank's previous one ended waited for a
  pipeline message: a ``recv_fwd``/``recv_bwd`` range (``bubble``) fills the gap, and
  the drain until the slowest stage ends is ``wait (drain)``;
* then, on every stage, the tied embedding's sum and the exposed dp reduction
  (``comm``), and the optimizer step (``optimizer``), the slowest stage's.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

from mtcore.parallel.pipeline import build_schedule, simulate
from mtcore.parallel.pipeline.schedules import FORWARD, RECV_BWD, RECV_FWD, WEIGHT
from mtcore.training.trace_format import PHASES_TID, TRACE_KEY
from mtcore.training.trace_merge import COLUMNS, summarize

COMM_KEYS = ("tp_comm", "cp_comm", "ep_comm", "pp_comm")


def planned_trace(plan) -> dict:
    """A Trace Event Format object of ``plan``'s step (microseconds from 0)."""
    lay = plan.layout
    pp, vpp, m = lay["pp"], lay.get("vpp") or 1, plan.microbatches
    schedule = build_schedule("no_pipelining" if pp == 1 else lay["schedule"], pp, m, vpp)
    per_mb = [sum(times.values()) for times in plan.stage_seconds]
    comm_share = [
        sum(times.get(k, 0.0) for k in COMM_KEYS) / total if total else 0.0
        for times, total in zip(plan.stage_seconds, per_mb, strict=True)
    ]

    def cost(rank: int, action) -> float:
        t = per_mb[rank] / vpp
        w = min(plan.weight_seconds[rank] / vpp, 2 * t / 3) if plan.weight_seconds else 0.0
        if action.kind == FORWARD:
            return t / 3
        if action.kind == WEIGHT:
            return w
        return 2 * t / 3 - (w if schedule.splits_backward else 0.0)

    timeline = simulate(schedule, cost=cost)
    us = 1e6
    t = plan.time
    tail = [("tied grads", "comm", t.tied_comm), ("dp grad sync", "comm", t.dp_exposed),
            ("optimizer", "optimizer", t.optimizer)]  # fmt: skip
    total = timeline.makespan + sum(seconds for _, _, seconds in tail)
    events: list[dict] = []
    for rank, items in enumerate(timeline.compute):
        pid = rank

        def add(name, category, start, dur, pid=pid, **args):
            events.append({"ph": "X", "name": name, "cat": f"mtcore.{category}", "pid": pid,
                           "tid": PHASES_TID, "ts": start * us, "dur": dur * us,
                           "args": {"category": category, **args}})  # fmt: skip

        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"stage {rank} (planned, {plan.hardware})"}})  # fmt: skip
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": PHASES_TID,
                       "args": {"name": "mtcore phases"}})  # fmt: skip
        add("step 1", "step", 0.0, total, step=1)
        clock = 0.0
        for action, start, end in items:
            mb, chunk = action.microbatch, action.chunk
            if start > clock + 1e-12:
                waited = RECV_FWD if action.kind == FORWARD else RECV_BWD
                add(f"{waited} mb{mb} c{chunk}", "bubble", clock, start - clock,
                    microbatch=mb, chunk=chunk)  # fmt: skip
            add(f"{action.kind} mb{mb} c{chunk}", "compute", start, end - start,
                microbatch=mb, chunk=chunk)  # fmt: skip
            comm = (end - start) * (comm_share[rank] if action.kind != WEIGHT else 0.0)
            if comm > 0:
                add("planned comm", "comm", end - comm, comm)
            clock = end
        if timeline.makespan > clock:
            add("wait (drain)", "bubble", clock, timeline.makespan - clock)
        clock = timeline.makespan
        for name, category, seconds in tail:
            if seconds > 0:
                add(name, category, clock, seconds)
                clock += seconds
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        TRACE_KEY: {
            "planned": True,
            "hardware": plan.hardware,
            "layout": lay,
            "stages": pp,
            "step_s": total,
            "planner_step_s": t.total,
        },
    }


def save(trace: dict, path: str | Path) -> None:
    """``trace`` as JSON at ``path`` (gzip where it ends in .gz), its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(trace, f)


def rows_of(trace: dict) -> list[int]:
    """The process rows that hold mtcore's phases: a merged trace's ranks, a planned
    trace's stages."""
    return sorted({e["pid"] for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("tid") == PHASES_TID})  # fmt: skip


def category_ms(trace: dict) -> dict[str, float]:
    """Milliseconds per step of each summary column and of the whole step ("step"), the
    mean over the trace's rows (every stage of a planned trace stands for as many ranks)."""
    summaries = [summarize(trace, pid=row) for row in rows_of(trace)]
    if not summaries:
        return dict.fromkeys(("step", *COLUMNS.values()), 0.0)
    per_step = [(s, max(s.steps, 1) * 1e3) for s in summaries]
    out = {"step": statistics.fmean(s.step_us / n for s, n in per_step)}
    for column in COLUMNS.values():
        out[column] = statistics.fmean(s.by_column[column] / n for s, n in per_step)
    return out


def format_categories(rows: list[tuple[str, dict, dict]]) -> str:
    """``(layout, measured category_ms, planned category_ms)`` rows as a table of
    "measured / planned" cells."""
    columns = ("step", *COLUMNS.values())
    lines = [f"{'layout':24s}" + "".join(f" {c:>15s}" for c in columns)]
    for layout, measured, planned in rows:
        cells = "".join(f" {measured[c]:7.1f} /{planned[c]:6.1f}" for c in columns)
        lines.append(f"{layout:24s}{cells}")
    return "\n".join(lines)
