"""pp2 x dp2: the data-parallel reduction overlapped with the pipeline's backward
(each chunk's buckets launched by its last backward) against all of it after the
pipeline (``overlap_grad_reduce=False``, the engine before the overlap).

    .venv/bin/python benchmarks/bench_pp_overlap.py           # 4 ranks, gloo

Both are the trainer's ``Engine`` (GPT, fp32, 1F1B, ``--vpp`` chunks per rank) on the
same batches, run interleaved one step each per round, median of ``--steps`` rounds,
slowest rank. "exposed ms" is the time the step spends in ``finish_grad_sync``
(waiting for the dp reductions after the pipeline is done): what the overlap hides.
On 4 ranks sharing the CPU cores, gloo's communication competes with compute, so
the step time gains less than the exposed time loses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import load_average

from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

CONFIGS = ("overlap", "after pipeline")


def _engine(ctx, args, overlap: bool):
    layout = ParallelLayout.build(
        LayoutSpec(pp=2, dp=2, vpp=args.vpp), ctx.backend.collective, ctx.rank, ctx.world_size
    )
    cfg = GPTConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=4, seq_len=args.seq,
        vocab_size=args.vocab,
    )  # fmt: skip
    engine = Engine(
        cfg, layout, ctx.backend, micro_batch_size=args.mb, num_microbatches=args.microbatches,
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0), seed=0,
        bucket_size=int(args.bucket_mb * 2**20 / 4),
    )  # fmt: skip
    if not overlap:
        engine.ddp.config = engine.ddp.config.model_copy(update={"overlap_grad_reduce": False})
    exposed: list[float] = []
    finish = engine.ddp.finish_grad_sync

    def timed_finish():
        start = time.perf_counter()
        finish()
        exposed.append(time.perf_counter() - start)

    engine.ddp.finish_grad_sync = timed_finish
    return engine, exposed, layout


def _rank_main(ctx, args):
    setups = {name: _engine(ctx, args, name == "overlap") for name in CONFIGS}
    layout = setups["overlap"][2]
    rows = args.mb * args.microbatches
    g = torch.Generator().manual_seed(1000 + layout.dp_cp.rank)
    tokens = torch.randint(
        0, args.vocab, (args.warmup + args.steps, rows, args.seq + 1), generator=g
    )
    times = {n: [] for n in CONFIGS}
    for r in range(args.warmup + args.steps):
        x = tokens[r]
        batches = lm_batches(x[:, :-1].split(args.mb), x[:, 1:].split(args.mb))
        for name in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            start = time.perf_counter()
            setups[name][0].train_step(batches)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
    w = args.warmup
    return {
        "step": {n: statistics.median(t) for n, t in times.items()},
        "exposed": {n: statistics.median(setups[n][1][w:]) for n in CONFIGS},
        "pp_rank": layout.coordinate(Axis.PP),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mb", type=int, default=2, help="micro-batch size")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print(load_average())
    ranks = run_ranks(_rank_main, 4, args, timeout_s=1800)
    print(
        f"GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}; pp2 x dp2 (vpp "
        f"{args.vpp}), {args.microbatches} micro-batches of {args.mb}; bucket {args.bucket_mb} MB; "
        f"median of {args.steps} steps"
    )
    print(f"{'config':<16}{'step ms':>9}{'exposed ms (stage 0)':>22}{'exposed ms (stage 1)':>22}")
    for name in CONFIGS:
        step = max(r["step"][name] for r in ranks)
        exposed = [max(r["exposed"][name] for r in ranks if r["pp_rank"] == s) for s in (0, 1)]
        print(f"{name:<16}{step * 1e3:>9.1f}{exposed[0] * 1e3:>22.1f}{exposed[1] * 1e3:>22.1f}")


if __name__ == "__main__":
    main()
