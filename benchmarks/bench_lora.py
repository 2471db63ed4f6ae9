"""LoRA against full training, side by side in one run: step time and per-rank peak
memory, measured and planned.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lora.py [--rounds 2] [--steps 3]

Each round trains `configs/default.yaml` widened as in `bench_sweep_memory.py` (hidden
512, 8 layers, seq 256, fp32, 4 sequences of one micro-batch) on 2 ranks at dp2, once
as it is and once with `finetune.lora` (rank 16 on q, k, v, o, fc1, fc2), alternating,
through `mtcore.plan.sweep` (every rank under torch's profiler: its peak of tensor bytes
held by the allocator, and the log's mean step time, as `mtcore sweep` measures). The
prediction is `mtcore plan`'s for cpu-host. Prints one row per run and the medians of
LoRA / full; exits 1 when a plan misses its measured peak by more than 15%.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_sweep_memory import BAND, DENSE

LAYOUT = "tp=1,pp=1"  # and dp 2, what 2 ranks leave
LORA = ["--finetune.lora.rank", "16", "--finetune.lora.targets", "[q, k, v, o, fc1, fc2]"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hardware", default="cpu-host")
    args = parser.parse_args()
    from mtcore.plan import load_hardware
    from mtcore.plan.sweep import compare

    hardware = load_hardware(args.hardware)
    print(
        f"{'run':>5s} {'step s':>7s} {'peak MB':>8s} {'planned MB':>11s} {'p/m':>5s} {'trained M':>10s}"
    )
    found: dict[str, list[tuple[float, float]]] = {"full": [], "lora": []}
    missed = 0
    for _ in range(args.rounds):
        for name, extra in (("full", []), ("lora", LORA)):
            measured, predicted = compare("configs/default.yaml", LAYOUT, 2, args.steps,
                                          [*DENSE, *extra], hardware)  # fmt: skip
            if measured.error:
                print(f"{name:>5s} failed: {measured.error}", flush=True)
                missed += 1
                continue
            ratio = predicted.peak_memory / measured.peak_bytes
            missed += abs(ratio - 1) > BAND
            found[name].append((measured.step_s, measured.peak_bytes))
            print(
                f"{name:>5s} {measured.step_s:7.3f} {measured.peak_bytes / 1e6:8.1f} "
                f"{predicted.peak_memory / 1e6:11.1f} {ratio:5.2f} "
                f"{predicted.ranks[0].params / 1e6:10.2f}",
                flush=True,
            )
    if found["full"] and found["lora"]:
        step = [statistics.median(s for s, _ in found[n]) for n in ("lora", "full")]
        peak = [statistics.median(p for _, p in found[n]) for n in ("lora", "full")]
        print(f"lora / full: step time {step[0] / step[1]:.2f}, peak {peak[0] / peak[1]:.2f}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
