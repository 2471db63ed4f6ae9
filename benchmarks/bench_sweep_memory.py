"""Measured vs planned per-rank peak memory, for seven layouts trained on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sweep_memory.py [--steps 3] [--only tp2 ep2]

Issue 21 asks the plan's per-rank peak to land within +-15% of what a run measures, for
tp2, pp2, tp2 x pp2, dp2 + ZeRO-1, pp2 x vpp2 and cp2 of configs/default.yaml and ep2
of configs/moe.yaml. Each layout trains `--steps` steps through `mtcore.plan.sweep`
(every rank under torch's profiler, its peak of tensor bytes held by the allocator);
the prediction is `mtcore plan`'s for cpu-host with the attention this backend runs.
The model is widened so that its state and activations are a few hundred MB per rank
(hidden 512, 8 layers, seq 256, fp32; the MoE one 4 layers of 8 experts of 512), and
a global batch of 4 sequences of one micro-batch keeps a step near two seconds.
Prints one row per layout (the largest rank; p/m: planned over measured) and the
planned and measured peak of every pipeline stage; exits 1 when a layout misses the band.
"""

from __future__ import annotations

import argparse
import sys
import time

DENSE = [
    "--model.hidden_size", "512", "--model.num_layers", "8", "--model.num_heads", "8",
    "--model.num_kv_heads", "2", "--model.seq_len", "256",
    "--training.global_batch_size", "4", "--training.micro_batch_size", "1",
]  # fmt: skip
MOE = [
    "--model.hidden_size", "512", "--model.num_layers", "4", "--model.num_heads", "8",
    "--model.num_kv_heads", "2", "--model.seq_len", "256", "--model.moe.ffn_size", "512",
    "--training.global_batch_size", "4", "--training.micro_batch_size", "1",
]  # fmt: skip
CASES = {  # name: (config, layout, ranks, model overrides)
    "tp2": ("configs/default.yaml", "tp=2,pp=1", 2, DENSE),
    "pp2": ("configs/default.yaml", "tp=1,pp=2", 2, DENSE),
    "tp2xpp2": ("configs/default.yaml", "tp=2,pp=2", 4, DENSE),
    "dp2+zero1": ("configs/default.yaml", "tp=1,pp=1,zero1", 2, DENSE),
    "pp2xvpp2": ("configs/default.yaml", "tp=1,pp=2,vpp=2", 2, DENSE),
    "cp2": ("configs/default.yaml", "tp=1,pp=1,cp=2", 2, DENSE),
    "ep2": ("configs/moe.yaml", "tp=1,ep=2", 2, MOE),
}
BAND = 0.15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="a subset of layouts")
    parser.add_argument("--hardware", default="cpu-host")
    args = parser.parse_args()
    from mtcore.plan import load_hardware
    from mtcore.plan.sweep import compare

    hardware = load_hardware(args.hardware)
    print(f"{'layout':10s} {'ranks':>5s} {'measured MB':>12s} {'planned MB':>11s} {'p/m':>6s}")
    missed = 0
    for name in args.only or CASES:
        config, layout, ranks, model = CASES[name]
        start = time.perf_counter()
        measured, predicted = compare(config, layout, ranks, args.steps, model, hardware)
        if measured.error:
            print(f"{name:10s} failed: {measured.error}", flush=True)
            missed += 1
            continue
        ratio = predicted.peak_memory / measured.peak_bytes
        missed += abs(ratio - 1) > BAND
        stages = ", ".join(
            f"stage {s} {planned / 1e6:.1f}/{got / 1e6:.1f}"
            for s, (planned, got) in sorted(stage_peaks(measured, predicted).items())
        )
        print(
            f"{name:10s} {ranks:5d} {measured.peak_bytes / 1e6:12.1f} "
            f"{predicted.peak_memory / 1e6:11.1f} {ratio:6.2f}   "
            f"({stages} planned/measured MB; {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return 1 if missed else 0


def stage_peaks(measured, predicted) -> dict[int, tuple[float, float]]:
    """``{stage: (planned peak, largest measured rank of that stage)}``."""
    from mtcore.plan.sweep import stage_of

    pp = len(predicted.ranks)
    out: dict[int, tuple[float, float]] = {}
    for rank, peak in measured.rank_peaks.items():
        stage = stage_of(rank, predicted.gpus, pp)
        got = max(peak, out.get(stage, (0, 0))[1])
        out[stage] = (predicted.ranks[stage].peak, got)
    return out


if __name__ == "__main__":
    sys.exit(main())
