"""Context parallelism for T5 and LLaVA: per-rank peak memory at cp=2 against cp=1.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cp_families.py [--steps 3] [--only t5]

Each row trains configs/t5.yaml or configs/llava.yaml through ``mtcore.plan.sweep``, as
``mtcore sweep`` does: every rank under torch's profiler, its peak of tensor bytes held
by the allocator (parameters, gradients, optimizer state and activations together),
the largest rank's printed. cp=1 runs on one rank, cp=2 on two ranks holding the same
micro-batches (one sequence each), so the difference is what splitting the sequence
saves; the plan's prediction for the same layout (``mtcore plan``, cpu-host) stands
beside it. The sequences are long (T5 1024 -> 256, LLaVA 1024) and the models small,
so activations dominate: T5's attention keeps its fp32 scores (the relative position
bias is added outside the kernel), ``[heads, s / cp, s]`` per layer. T5 runs
``cp_method: allgather`` (the one it takes); LLaVA the default ring, its vision tower
replicated on both cp ranks. Prints ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T5 = [
    "--model.seq_len", "1024", "--model.decoder_seq_len", "256", "--model.dropout", "0.0",
    "--training.global_batch_size", "2", "--training.micro_batch_size", "1",
]  # fmt: skip
LLAVA = [
    "--model.seq_len", "1024",
    "--training.global_batch_size", "2", "--training.micro_batch_size", "1",
]  # fmt: skip
CASES = {  # name: (config, layout, ranks, overrides)
    "t5 cp1": ("configs/t5.yaml", "tp=1,pp=1,dp=1", 1, T5),
    "t5 cp2": ("configs/t5.yaml", "tp=1,pp=1,cp=2,cp_method=allgather", 2, T5),
    "llava cp1": ("configs/llava.yaml", "tp=1,pp=1,dp=1", 1, LLAVA),
    "llava cp2": ("configs/llava.yaml", "tp=1,pp=1,cp=2", 2, LLAVA),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=("t5", "llava"), help="one family")
    args = parser.parse_args()
    from mtcore.plan import load_hardware
    from mtcore.plan.sweep import compare

    hardware = load_hardware("cpu-host")
    print(f"uptime: {os.getloadavg()}")
    print(f"{'case':10s} {'ranks':>5s} {'measured MB':>12s} {'planned MB':>11s} {'s/step':>7s}")
    failed, peaks = 0, {}
    for name, (config, layout, ranks, overrides) in CASES.items():
        if args.only and not name.startswith(args.only):
            continue
        start = time.perf_counter()
        measured, predicted = compare(config, layout, ranks, args.steps, overrides, hardware)
        if measured.error:
            print(f"{name:10s} failed: {measured.error}", flush=True)
            failed += 1
            continue
        peaks[name] = measured.peak_bytes
        print(
            f"{name:10s} {ranks:5d} {measured.peak_bytes / 1e6:12.1f} "
            f"{predicted.peak_memory / 1e6:11.1f} {measured.step_s:7.2f}   "
            f"(ranks {sorted(round(p / 1e6, 1) for p in measured.rank_peaks.values())} MB; "
            f"{time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    for family in ("t5", "llava"):
        if f"{family} cp1" in peaks and f"{family} cp2" in peaks:
            ratio = peaks[f"{family} cp2"] / peaks[f"{family} cp1"]
            print(f"{family}: cp2 / cp1 peak per rank = {ratio:.2f}")
    print(f"uptime: {os.getloadavg()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
