"""The default job (configs/default.yaml: tp=2 x pp=2 on 4 local ranks) in bf16 against FP8.

    .venv/bin/python benchmarks/bench_fp8_job.py [--rounds 3 --steps 30 --interval 10]
        [--precisions bf16 fp8-delayed fp8-current fp8-blockwise fp32 fp32-fp8-current]

Each precision is one ``mtcore train configs/default.yaml --nproc 4`` run, as a user
starts it (``--training.steps``, no evaluation, checkpoint in a temporary directory);
the step time is the trainer's own ``s/step`` of every logging interval after the
first (the first holds start-up and the first step), and so is the CPU time of a step
(the log line's ``cpu N ms/step``: every rank's CPU time over the interval, summed, per
step). Runs alternate: in each round every precision runs once, the order rotating
from round to round, so load from other processes falls on all alike. Reported: each
precision's median wall and CPU time per step, their paired ratios to ``bf16`` (median
over rounds of the ratio in the same round) with each round's, its last loss, and the
FP8 GEMM path the backend took (``mtcore doctor``'s line). ``uptime`` before and after.
Wall time on a shared machine measures the other processes as much as the job; CPU
time much less so. FP8 runs use the hybrid format (E4M3 forward, E5M2 gradients) unless
the name says ``e4m3``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "bf16": ["--precision.dtype", "bf16"],
    "fp8-delayed": ["--precision.dtype", "bf16", "--precision.fp8", "hybrid"],
    "fp8-current": ["--precision.dtype", "bf16", "--precision.fp8", "hybrid",
                    "--precision.fp8_recipe", "current"],
    "fp8-e4m3-current": ["--precision.dtype", "bf16", "--precision.fp8", "e4m3",
                         "--precision.fp8_recipe", "current"],
    "fp8-blockwise": ["--precision.dtype", "bf16", "--precision.fp8", "hybrid",
                      "--precision.fp8_recipe", "blockwise"],
    "fp32": [],
    "fp32-fp8-current": ["--precision.fp8", "e4m3", "--precision.fp8_recipe", "current"],
}  # fmt: skip
# the trainer's log line; the step time is read from tokens/s (s/step has 2 decimals)
STEP_LINE = re.compile(
    r"step (\d+)/\d+ \| loss ([\d.]+) .*\| ([\d,]+) tokens/s .*\| cpu (\d+) ms/step"
)
TOKENS_PER_STEP = 16 * 128  # configs/default.yaml: global batch 16 x seq 128


def run_job(name: str, steps: int, interval: int, workdir: Path) -> dict:
    cmd = [
        str(ROOT / ".venv/bin/mtcore"), "train", str(ROOT / "configs/default.yaml"), "--nproc", "4",
        "--training.steps", str(steps), "--training.eval_interval", "0",
        "--logging.interval", str(interval), "--checkpoint.dir", str(workdir / name),
        *PRECISIONS[name],
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=3600)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{name}: exit {out.returncode}\n{text[-3000:]}")
    found = [
        (int(s), float(loss), TOKENS_PER_STEP / float(rate.replace(",", "")), float(cpu) / 1e3)
        for s, loss, rate, cpu in STEP_LINE.findall(text)
    ]
    timed = [(wall, cpu) for step, _, wall, cpu in found if step > interval]
    paths = re.findall(r"fp8 \(.*", text)
    return {
        "step_s": statistics.mean(wall for wall, _ in timed),
        "cpu_s": statistics.mean(cpu for _, cpu in timed),
        "loss": found[-1][1],
        "paths": paths[:1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8-delayed", "fp8-current",
                        "fp8-blockwise"], choices=list(PRECISIONS))  # fmt: skip
    args = parser.parse_args()
    names = args.precisions if "bf16" in args.precisions else ["bf16", *args.precisions]
    print(f"load at start: {load_average()}")
    times = {name: {"step_s": [], "cpu_s": []} for name in names}
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = run_job(name, args.steps, args.interval, Path(tmp))
                for key in times[name]:
                    times[name][key].append(res[key])
                last[name] = res
                print(f"round {r + 1}: {name:<18} {res['step_s'] * 1e3:7.1f} ms/step, "
                      f"cpu {res['cpu_s'] * 1e3:7.1f} ms/step (all ranks), "
                      f"loss {res['loss']:.4f} | {load_average()}", flush=True)  # fmt: skip
    print(f"load at end: {load_average()}")
    print("\n| precision | wall ms/step (median) | wall ratio to bf16 (paired) | per round "
          "| CPU ms/step, all ranks (median) | CPU ratio to bf16 (paired) | per round "
          "| last loss |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name in names:
        cells = []
        for key in ("step_s", "cpu_s"):
            ratios = [a / b for a, b in zip(times[name][key], times["bf16"][key], strict=True)]
            cells += [
                f"{statistics.median(times[name][key]) * 1e3:.1f}",
                f"{statistics.median(ratios):.3f}",
                ", ".join(f"{x:.3f}" for x in ratios),
            ]
        print(f"| {name} | {' | '.join(cells)} | {last[name]['loss']:.4f} |")
    for name in names:
        for line in last[name]["paths"]:
            print(f"{name}: {line}")


if __name__ == "__main__":
    main()
