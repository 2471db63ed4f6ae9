"""One timeline from the ranks' traces, and where each rank's step time went.

``merge`` reads every ``rank<r>.json.gz`` that ``logging.profile`` wrote, gives each rank
one process row (pid = rank, named "rank r (host)"), and shifts each rank's clock onto
one timeline: the ranks of one host keep the host's own clock (Linux's CLOCK_MONOTONIC,
which every process of a host reads alike: exact), and the hosts are aligned where their
first rank left the barrier of the first traced step (its ``mtcore sync`` mark), which is
as good as the barrier's exit skew. Traces without the host clock (written before it
was recorded, or on a system where perf_counter is not CLOCK_MONOTONIC) are aligned at
the barrier rank by rank. The result loads in Perfetto (ui.perfetto.dev) and
chrome://tracing.

``summarize`` splits each traced step of each rank into the planner's categories
(``mtcore.plan``: compute, exposed communication, bubble, optimizer, data) from
mtcore's phases: a moment of the step belongs to the innermost phase open then (a wait
for a ZeRO-3 gather inside a forward is communication, not compute), and a moment in
no phase is "other" (Python between the phases). So the categories add up to the step.
Asynchronous reductions (the "in flight" track) overlap the phases and count only
where a phase waits for them.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from mtcore.training.trace_format import ASYNC_TID, PHASES_TID, TRACE_KEY

# Trace categories -> the summary's columns, in the planner's words.
COLUMNS = {
    "compute": "compute",
    "comm": "exposed comm",
    "bubble": "bubble",
    "optimizer": "optimizer",
    "data": "data",
    "step": "other",
}


class TraceError(ValueError):
    """No trace to merge, or one that is not mtcore's; the message says which."""


def trace_files(run_dir: str | Path) -> list[Path]:
    """The ranks' traces under ``run_dir`` (a run directory, or its traces/ directly)."""
    root = Path(run_dir)
    for directory in (root / "traces", root):
        found = sorted(directory.glob("rank*.json.gz"), key=_rank_of)
        if found:
            return found
    raise TraceError(f"no rank<r>.json.gz under {root} or {root / 'traces'} (logging.profile)")


def _rank_of(path: Path) -> int:
    match = re.match(r"rank(\d+)\.json\.gz$", path.name)
    return int(match.group(1)) if match else -1


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    if TRACE_KEY not in trace:
        raise TraceError(f"{path} is not a trace written by logging.profile (no {TRACE_KEY!r})")
    return trace


def merge(traces: list[dict]) -> dict:
    """One Trace Event Format object: every rank's events on its own process row, the
    clocks aligned at the ranks' sync marks (time 0 is the earliest event)."""
    shifted: list[dict] = []
    after_host_sync = _after_host_sync_us(traces)
    for trace in traces:
        info = trace[TRACE_KEY]
        rank = info["rank"]
        # the host's first sync mark at 0; the rank's own this long after it
        offset = -info["sync_us"] + after_host_sync.get(rank, 0.0)
        shifted.append({"ph": "M", "name": "process_name", "pid": rank,
                        "args": {"name": f"rank {rank} ({info['host']})"}})  # fmt: skip
        shifted.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                        "args": {"sort_index": rank}})  # fmt: skip
        for event in trace["traceEvents"]:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index"):
                continue
            event = dict(event, pid=rank)
            if "ts" in event:
                event["ts"] = float(event["ts"]) + offset
            shifted.append(event)
    start = min((e["ts"] for e in shifted if "ts" in e), default=0.0)
    for event in shifted:
        if "ts" in event:
            event["ts"] -= start
    ranks = [t[TRACE_KEY]["rank"] for t in traces]
    return {
        "traceEvents": shifted,
        "displayTimeUnit": "ms",
        TRACE_KEY: {
            "ranks": ranks,
            "aligned_at": "one clock per host; hosts at the barrier of the first traced step",
        },
    }


def _after_host_sync_us(traces: list[dict]) -> dict[int, float]:
    """{rank: microseconds from its host's first sync mark to its own}, read on the
    host's CLOCK_MONOTONIC; hosts where some trace lacks that clock are left out (their
    ranks align at the barrier itself: 0)."""
    by_host: dict[str, list[dict]] = {}
    for trace in traces:
        by_host.setdefault(trace[TRACE_KEY]["host"], []).append(trace[TRACE_KEY])
    after: dict[int, float] = {}
    for infos in by_host.values():
        if not all("CLOCK_MONOTONIC" in str(i.get("clock")) and "sync_clock_ns" in i for i in infos):
            continue
        first = min(i["sync_clock_ns"] for i in infos)
        after.update({i["rank"]: (i["sync_clock_ns"] - first) / 1e3 for i in infos})
    return after


@dataclass
class RankSummary:
    rank: int
    steps: int
    step_us: float  # the traced steps' total
    by_column: dict[str, float] = field(default_factory=dict)  # column -> microseconds


def phases(trace: dict, pid=None) -> list[dict]:
    """mtcore's ranges on the phases track (the main thread), in start order; ``pid``:
    one process row's (a merged or planned trace's rank or stage)."""
    found = [
        e for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("tid") == PHASES_TID and (pid is None or e["pid"] == pid)
    ]  # fmt: skip
    return sorted(found, key=lambda e: (e["ts"], -e["dur"]))


def in_flight(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == ASYNC_TID]


def summarize(trace: dict, pid=None) -> RankSummary:
    """Each column's time over the traced steps: the self time of its phases (a phase's
    time less that of the phases inside it), a step's own self time being "other".
    ``pid``: one row of a trace with several (the planned one's stages)."""
    by_column = dict.fromkeys(COLUMNS.values(), 0.0)
    events = phases(trace, pid)
    steps = [e for e in events if e["args"].get("category") == "step"]
    stack: list[tuple[dict, float]] = []  # open phases and their children's time so far

    def close_until(ts: float) -> None:
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= ts + 1e-3:
            event, inner = stack.pop()
            column = COLUMNS.get(event["args"].get("category"), "other")
            by_column[column] += max(event["dur"] - inner, 0.0)
            if stack:
                parent, total = stack[-1]
                stack[-1] = (parent, total + event["dur"])

    for event in events:
        close_until(event["ts"])
        if not stack and event["args"].get("category") != "step":
            continue  # outside every traced step (the barrier's moment, a last save)
        stack.append((event, 0.0))
    close_until(float("inf"))
    total = sum(e["dur"] for e in steps)
    rank = pid if pid is not None else trace[TRACE_KEY]["rank"]
    return RankSummary(rank, len(steps), total, by_column)


def format_summary(summaries: list[RankSummary], width: int = 30, row: str = "rank") -> str:
    """A table per rank (ms per step and share of the step) and an ASCII bar of the
    shares: C compute, X exposed comm, B bubble, O optimizer, D data, . other."""
    letters = dict(zip(COLUMNS.values(), "CXBOD.", strict=True))
    head = f"{row:>5} {'step ms':>9}" + "".join(f" {c:>14}" for c in COLUMNS.values())
    lines = [head]
    for s in summaries:
        per = s.step_us / max(s.steps, 1) / 1e3
        cells = "".join(
            f" {s.by_column[c] / max(s.steps, 1) / 1e3:8.1f} {_share(s, c):>5}"
            for c in COLUMNS.values()
        )
        lines.append(f"{s.rank:>5} {per:>9.1f}{cells}")
    lines.append("")
    for s in summaries:
        bar, done, filled = "", 0.0, 0
        for c in COLUMNS.values():  # cumulative rounding: the bar is always ``width`` long
            done += s.by_column[c] / s.step_us if s.step_us else 0.0
            upto = round(width * done)
            bar, filled = bar + letters[c] * (upto - filled), upto
        lines.append(f"{row} {s.rank:>3} |{bar:<{width}}|")
    lines.append("  C compute  X exposed comm  B bubble  O optimizer  D data  . other")
    return "\n".join(lines)


def memory_peaks(trace: dict, pid=None) -> dict[str, int]:
    """With ``logging.profile.memory``: per kind of phase (its name's first word:
    forward, backward, optimizer, ...), the highest memory reading at one's end."""
    peaks: dict[str, int] = {}
    for event in phases(trace, pid):
        value = event["args"].get("memory_bytes")
        if value is not None and event["args"].get("category") != "step":
            kind = event["name"].split()[0]
            peaks[kind] = max(peaks.get(kind, 0), int(value))
    return peaks


def format_memory(rank: int, peaks: dict[str, int]) -> str:
    top = sorted(peaks.items(), key=lambda kv: -kv[1])[:6]
    return f"rank {rank:>3} peak memory by phase: " + ", ".join(
        f"{kind} {value / 2**20:.0f} MiB" for kind, value in top
    )


def _share(s: RankSummary, column: str) -> str:
    return f"{100 * s.by_column[column] / s.step_us:.0f}%" if s.step_us else "-"
