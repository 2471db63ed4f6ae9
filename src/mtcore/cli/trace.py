"""Traces of a run: `mtcore trace merge RUN_DIR [--output FILE]`.

`merge` reads the per-rank traces `logging.profile` wrote (RUN_DIR/traces/rank<r>.json.gz,
or RUN_DIR itself holding them), writes one timeline with a process row per rank, the
ranks' clocks aligned at the barrier of the first traced step (default
RUN_DIR/traces/merged.json.gz; open it in https://ui.perfetto.dev or chrome://tracing),
and prints per rank where the traced steps' time went: compute, exposed communication,
bubble, optimizer, data, and other (docs/training.md, "Profiling").
"""

from __future__ import annotations

import argparse
import sys

HELP = "merge the ranks' traces of a run into one timeline and print where the step time went"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser("merge", help="one timeline from the ranks' traces, and a summary")
    merge.add_argument("run_dir", metavar="RUN_DIR", help="e.g. runs/default (or its traces/)")
    merge.add_argument(
        "--output", metavar="FILE", help="where the timeline goes (default <traces>/merged.json.gz)"
    )
    merge.add_argument("--json", action="store_true", help="the summary as JSON")


def run(args: argparse.Namespace) -> int:
    import gzip
    import json

    from mtcore.training.trace_merge import (
        TraceError,
        format_memory,
        format_summary,
        load,
        memory_peaks,
        merge,
        summarize,
        trace_files,
    )

    try:
        files = trace_files(args.run_dir)
        traces = [load(path) for path in files]
    except (TraceError, OSError, ValueError) as e:
        print(f"mtcore trace: error: {e}", file=sys.stderr)
        return 1
    output = args.output or str(files[0].parent / "merged.json.gz")
    merged = merge(traces)
    opener = gzip.open if output.endswith(".gz") else open
    with opener(output, "wt") as f:
        json.dump(merged, f)
    summaries = [summarize(trace) for trace in traces]
    if args.json:
        rows = [
            {"rank": s.rank, "steps": s.steps, "step_ms": s.step_us / max(s.steps, 1) / 1e3,
             **{c: v / max(s.steps, 1) / 1e3 for c, v in s.by_column.items()},
             "peak_bytes_by_phase": memory_peaks(trace)}
            for s, trace in zip(summaries, traces, strict=True)
        ]  # fmt: skip
        print(json.dumps({"timeline": output, "ranks": rows}, indent=2))
        return 0
    print(f"timeline: {output} ({len(traces)} ranks; open in https://ui.perfetto.dev)")
    print("ms per traced step, and share of the step:")
    print(format_summary(summaries))
    for trace, s in zip(traces, summaries, strict=True):
        if peaks := memory_peaks(trace):  # logging.profile.memory
            print(format_memory(s.rank, peaks))
    return 0
