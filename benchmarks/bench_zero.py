"""Per-rank peak memory under ZeRO 0, 1, 2 and 3 at dp2, measured against the planner's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero.py [--steps 3] [--bucket 2000000]

Each stage trains `configs/default.yaml` widened as in `bench_sweep_memory.py` (hidden
512, 8 layers, seq 256, fp32, 4 sequences of one micro-batch: two micro-batches per dp
rank) on 2 ranks through `mtcore.plan.sweep` (every rank under torch's profiler, its
peak of tensor bytes held by the allocator, as `mtcore sweep` measures), with
`parallel.zero` set and a bucket of `--bucket` elements (the default 40M would hold the
whole model in one bucket, and ZeRO-2's one live whole bucket would be the whole
gradient). The prediction is `mtcore plan`'s for cpu-host (`plan.memory`: weights and
optimizer state 18, 6 + 12/d, 2 + 16/d and 18/d bytes a parameter for ZeRO 0, 1, 2, 3,
plus activations and the transient buffers). mtcore's ZeRO-3 keeps the params outside the
transformer blocks whole (embedding, output layer, final norm: 4.2M of the 26.7M here),
which the plan does not know. Prints one row per stage; exits 1 when a stage's plan
misses the measurement by more than 15%.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_sweep_memory import BAND, DENSE

LAYOUT = "tp=1,pp=1"  # and dp 2, what 2 ranks leave


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=2_000_000, help="elements per bucket")
    parser.add_argument("--hardware", default="cpu-host")
    args = parser.parse_args()
    from mtcore.plan import load_hardware
    from mtcore.plan.sweep import compare

    hardware = load_hardware(args.hardware)
    print(
        f"{'zero':>4s} {'measured MB':>12s} {'planned MB':>11s} {'p/m':>6s} "
        f"{'state MB':>9s} {'transient MB':>13s}"
    )
    missed = 0
    for zero in (0, 1, 2, 3):
        overrides = [*DENSE, "--parallel.bucket_size", str(args.bucket)]
        start = time.perf_counter()
        overrides += ["--parallel.zero", str(zero)]
        measured, predicted = compare("configs/default.yaml", LAYOUT, 2, args.steps,
                                      overrides, hardware)  # fmt: skip
        if measured.error:
            print(f"{zero:4d} failed: {measured.error}", flush=True)
            missed += 1
            continue
        rank = predicted.ranks[0]
        ratio = predicted.peak_memory / measured.peak_bytes
        missed += abs(ratio - 1) > BAND
        print(
            f"{zero:4d} {measured.peak_bytes / 1e6:12.1f} {predicted.peak_memory / 1e6:11.1f} "
            f"{ratio:6.2f} {rank.state / 1e6:9.1f} {rank.transient / 1e6:13.1f}"
            f"   ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
