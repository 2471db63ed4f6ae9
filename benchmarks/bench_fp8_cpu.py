"""CPU seconds per step of the default job (all 4 ranks together), bf16 against FP8.

    .venv/bin/python benchmarks/bench_fp8_cpu.py [bf16 fp8-blockwise fp8-current fp8-delayed]

Each precision runs ``mtcore train configs/default.yaml --nproc 4`` twice, as
``bench_fp8_job.py`` does, for 30 and for 10 steps; the CPU time (user + system) of the
run and every process it waited for, divided over the 20 steps between, is the CPU cost
of a step without start-up. Wall time on a shared machine measures the other processes
too; CPU time much less so. ``uptime`` before and after. One run per length: the
start-up's CPU (about 35 s) varies by several seconds from run to run, as much as the
steps' differences between precisions, so two runs of this disagreed by up to 0.55 in
the ratios (docs/fp8.md); repeat it, or read the steps' CPU time from inside the job.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average
from bench_fp8_job import PRECISIONS, ROOT


def cpu_seconds(name: str, steps: int, workdir: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [
        str(ROOT / ".venv/bin/mtcore"), "train", str(ROOT / "configs/default.yaml"), "--nproc", "4",
        "--training.steps", str(steps), "--training.eval_interval", "0",
        "--logging.interval", "10", "--checkpoint.dir", str(workdir / f"{name}-{steps}"),
        *PRECISIONS[name],
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=workdir, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    names = sys.argv[1:] or ["bf16", "fp8-blockwise", "fp8-current", "fp8-delayed"]
    names = names if "bf16" in names else ["bf16", *names]
    print(f"load at start: {load_average()}")
    per_step = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            long, short = cpu_seconds(name, 30, Path(tmp)), cpu_seconds(name, 10, Path(tmp))
            per_step[name] = (long - short) / 20
            print(f"{name}: {long:.1f} CPU s for 30 steps, {short:.1f} for 10 -> "
                  f"{per_step[name] * 1e3:.0f} CPU ms/step | {load_average()}", flush=True)  # fmt: skip
    print(f"load at end: {load_average()}")
    print("\n| precision | CPU ms/step (4 ranks) | ratio to bf16 |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {per_step[name] * 1e3:.0f} | {per_step[name] / per_step['bf16']:.3f} |")


if __name__ == "__main__":
    main()
