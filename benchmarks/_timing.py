"""Timing shared by the side-by-side trainer benchmarks (bench_trainer.py, bench_bert.py).

Several configurations of one training step run in one process, in turn: warm-up
steps first (not timed), then rounds in which each configuration runs
``steps_per_round`` steps before the next one starts. Load from other processes
then falls on all of them alike; the figure least moved by it is the per-round
("paired") ratio of a configuration's time to the baseline's in the same round.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Step = Callable[[int], float]  # global step index (0-based, warm-up included) -> loss


@dataclass
class Timings:
    """Per configuration: each round's step times (seconds) and the last step's loss."""

    rounds: dict[str, list[list[float]]]
    final_loss: dict[str, float]

    def steps(self, name: str) -> list[float]:
        return [t for r in self.rounds[name] for t in r]


def load_average() -> str:
    """``uptime``'s line (the 1, 5 and 15 minute load averages)."""
    if shutil.which("uptime"):
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"


def alternate(
    steps: Mapping[str, Step], rounds: int, steps_per_round: int = 1, warmup: int = 0
) -> Timings:
    """Run ``warmup`` untimed steps of each configuration, one by one in turn, then
    ``rounds`` rounds of ``steps_per_round`` timed steps of each, configuration after
    configuration. Step ``i`` of every configuration gets the same index ``i``."""
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    final: dict[str, float] = {}
    for i in range(warmup):
        for name, step in steps.items():
            final[name] = step(i)
    for r in range(rounds):
        for name, step in steps.items():
            spent = []
            for j in range(steps_per_round):
                t0 = time.perf_counter()
                final[name] = step(warmup + r * steps_per_round + j)
                spent.append(time.perf_counter() - t0)
            times[name].append(spent)
    return Timings(times, final)


def report(timings: Timings, baseline: str, tokens_per_step: int) -> None:
    """A row per configuration: median step time, tokens/s, ratio of medians to the
    baseline's, median over rounds of the per-round ratio, and the last loss; then the
    load average at the end (with the one at the start: how busy the machine was)."""
    base = timings.rounds[baseline]
    base_median = statistics.median(timings.steps(baseline))
    print(f"{'configuration':<15} {'median ms':>10} {'tokens/s':>10} {'ratio':>7} {'paired':>7}  final loss")
    for name, rounds in timings.rounds.items():
        med = statistics.median(timings.steps(name))
        paired = statistics.median(sum(a) / sum(b) for a, b in zip(rounds, base, strict=True))
        print(
            f"{name:<15} {med * 1e3:>10.1f} {tokens_per_step / med:>10,.0f} "
            f"{med / base_median:>7.3f} {paired:>7.3f}  {timings.final_loss[name]:.6f}"
        )
    print(f"load at end: {load_average()}")
