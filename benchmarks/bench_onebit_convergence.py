"""The default job at dp=4 with 1-bit Adam against AdamW: final training and validation loss.

    .venv/bin/python benchmarks/bench_onebit_convergence.py                  # ~6 min on 2 cores
    .venv/bin/python benchmarks/bench_onebit_convergence.py --freeze-step 40 --block-size 2048

Runs ``configs/default.yaml`` as ``--parallel.tp 1 --parallel.pp 1 --parallel.dp 4``
(4 ranks, 200 steps) twice through torchrun and ``benchmarks/dump_losses.py``: with
AdamW, then with ``--optimizer.name onebit_adam``. Same data, seed and schedule, so the
first ``freeze_step`` steps are equal and the rest shows what the compression costs.
Prints the last step's training loss, the mean of the last 10 and the final validation
loss of each, and the relative differences (issue 19 target: within 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "--parallel.tp", "1", "--parallel.pp", "1", "--parallel.dp", "4",
    "--training.sample_tokens", "0", "--checkpoint.dir", "null",
    "--logging.tensorboard_dir", "null",
]  # fmt: skip


def _run(out: Path, extra: list[str]) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "4"]
    cmd += [str(ROOT / "benchmarks" / "dump_losses.py"), str(out), "configs/default.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd + COMMON + extra, cwd=ROOT, env=env, check=True, capture_output=True)
    record = json.loads(out.read_text())
    losses = [float(x) for x in record["losses"]]
    return {
        "final": losses[-1],
        "last10": sum(losses[-10:]) / 10,
        "val": float(record["val"][-1][1]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--freeze-step", type=int, default=100)
    p.add_argument("--block-size", type=int, default=128)
    args = p.parse_args()
    onebit = ["--optimizer.name", "onebit_adam", "--optimizer.freeze_step", str(args.freeze_step)]
    onebit += ["--optimizer.block_size", str(args.block_size)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "AdamW": _run(Path(tmp) / "adamw.json", []),
            "1-bit Adam": _run(Path(tmp) / "onebit.json", onebit),
        }
    print(f"default job, dp=4, 200 steps; 1-bit Adam freeze_step {args.freeze_step}, "
          f"block_size {args.block_size}")  # fmt: skip
    print(f"{'optimizer':<12}{'final train':>12}{'last 10':>10}{'val':>10}")
    for name, r in runs.items():
        print(f"{name:<12}{r['final']:>12.4f}{r['last10']:>10.4f}{r['val']:>10.4f}")
    base, mine = runs["AdamW"], runs["1-bit Adam"]
    rel = {k: mine[k] / base[k] - 1 for k in base}
    print(f"{'difference':<12}{rel['final']:>+12.1%}{rel['last10']:>+10.1%}{rel['val']:>+10.1%}")


if __name__ == "__main__":
    main()
