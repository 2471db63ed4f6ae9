"""Measure layouts with ``mtcore train`` and set the plan's prediction beside each.

Each layout runs as its own ``mtcore train`` (a fresh process group, a few steps, no
checkpoint or tensorboard); its log lines give the step time (median after the
first step, which pays warm-up) and the peak memory the trainer reports (the
maximum over ranks of ``backend.device.max_memory_allocated``: on the host backend
the process's peak resident set, which includes the framework itself).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

from mtcore.plan.layouts import layout_overrides

_STEP = re.compile(r"step (\d+)/\d+ \|.*\| mem ([\d.]+) (B|KiB|MiB|GiB) \| ([\d.]+) s/step")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
QUIET = [
    "--checkpoint.dir", "null", "--logging.tensorboard_dir", "null", "--logging.interval", "1",
    "--logging.progress", "lines", "--training.sample_tokens", "0",
    "--training.eval_batches", "1",
]  # fmt: skip


@dataclass
class Measured:
    layout: str
    step_s: float | None
    peak_bytes: float | None
    error: str = ""


def parse_log(text: str) -> tuple[float | None, float | None]:
    """(median seconds per step after the first, the largest reported peak memory)."""
    steps = [(int(m[0]), float(m[1]) * _UNITS[m[2]], float(m[3])) for m in _STEP.findall(text)]
    if not steps:
        return None, None
    times = [s for i, _, s in steps if i > 1] or [steps[-1][2]]
    return statistics.median(times), max(mem for _, mem, _ in steps)


def measure(
    config: str | None, layout: str, nproc: int, steps: int, overrides: list[str]
) -> Measured:
    """Run ``mtcore train`` on ``layout`` for ``steps`` steps on ``nproc`` local ranks."""
    args = [sys.executable, "-m", "mtcore.cli.main", "train", *([config] if config else [])]
    args += ["--nproc", str(nproc), *overrides, *layout_overrides(layout), *QUIET]
    args += ["--training.steps", str(steps), "--training.eval_interval", str(steps + 1)]
    done = subprocess.run(args, capture_output=True, text=True)
    step_s, peak = parse_log(done.stdout + done.stderr)
    if done.returncode != 0 or step_s is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Measured(layout, step_s, peak, f"exit {done.returncode}: {last}")
    return Measured(layout, step_s, peak)
