"""How soon a multi-rank job trains: `mtcore train` (ranks forked from its rank server)
against ``torchrun -m mtcore.train`` (a new interpreter per rank, as `mtcore train`
started them before), the same job and the same ranks.

    .venv/bin/python benchmarks/bench_launch.py [--rounds 5 --nproc 4 --steps 2]

The job is configs/default.yaml (tp=2 x pp=2), cut to ``--steps`` steps with no
evaluation, sample, checkpoint or TensorBoard. Each round runs both commands, the
order alternating from round to round. Reported per command: the median seconds
from start to rank 0's first step line, and to the command's exit with its output
closed (what a script or CI waiting on the job sees), and the paired ratios
(mtcore train / torchrun) of both. Only wall time: the forked ranks are not the
launcher's children, so a CPU time read from the launcher would leave them out.
``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"


def commands(nproc: int, steps: int) -> dict[str, list[str]]:
    job = [
        str(ROOT / "configs/default.yaml"), "--training.steps", str(steps),
        "--training.eval_interval", "0", "--training.sample_prompt", "null",
        "--checkpoint.dir", "null", "--logging.tensorboard_dir", "null",
        "--logging.interval", "1",
    ]  # fmt: skip
    torchrun = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m"]
    return {
        "mtcore train": [str(BIN / "mtcore"), "train", *job, "--nproc", str(nproc)],
        "torchrun": [*torchrun, "mtcore.train", *job],
    }


def time_one(command: list[str]) -> tuple[float, float]:
    """Seconds to the first ``step`` line, and to the exit with the output closed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/tmp",
        env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin"},
    )  # fmt: skip
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("step "):
            first = time.monotonic() - start
    proc.wait()
    done = time.monotonic() - start
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"{command[0]} exited {proc.returncode}:\n{''.join(lines[-30:])}")
    return first, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print(load_average())
    runs = commands(args.nproc, args.steps)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(time_one(runs[name]))
        print(f"round {i + 1}: " + ", ".join(
            f"{name} {times[name][-1][0]:.2f} s to step 1, {times[name][-1][1]:.2f} s in all"
            for name in names
        ), flush=True)  # fmt: skip
    for name in names:
        first, done = zip(*times[name], strict=True)
        print(f"{name}: median {statistics.median(first):.2f} s to the first step line, "
              f"{statistics.median(done):.2f} s to the end")  # fmt: skip
    ours, theirs = times["mtcore train"], times["torchrun"]
    for what, index in (("first step", 0), ("end", 1)):
        ratios = [a[index] / b[index] for a, b in zip(ours, theirs, strict=True)]
        print(f"mtcore train / torchrun, {what}: median {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip
    print(load_average())


if __name__ == "__main__":
    main()
