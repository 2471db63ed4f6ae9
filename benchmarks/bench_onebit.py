"""1-bit Adam (compression stage) against AdamW at dp=4: step time and bytes per step.

    .venv/bin/python benchmarks/bench_onebit.py            # 4 ranks, gloo

Both run in one launch of 4 ranks (gloo, one thread per rank), on copies of the
same GPT (Llama style, fp32) with the same batches and hyper-parameters. 1-bit
Adam's ``freeze_step`` equals ``--warmup``, so every timed step is in the
compression stage. The two run interleaved, one step each per round, so machine
noise hits both alike; each reports the median of ``--steps`` rounds, slowest rank.

Columns: "step ms" (zero_grad + forward + backward + gradient sync + optimizer
step), the phases of rank 0 (bwd includes AdamW's in-backward bucket reductions;
sync is ``finish_grad_sync``; optim is ``step()``, which for 1-bit Adam holds the
compressed momentum reduction), and "dp bytes": what this rank handed to collectives
over the data-parallel group per step (the input of each all-reduce, all-to-all and
all-gather), counted by wrapping the collective. On one machine's loopback the
bytes are the portable figure; step time on gloo over shared cores says little
about a network-bound cluster.

DeepSpeed's OneBitAdam is not run: its compressed all-reduce has NCCL (with cupy),
MPI and HCCL backends, none over gloo on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.optimizer import AdamW, OneBitAdam
from mtcore.testing.distributed import run_ranks

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = ("AdamW", "1-bit Adam")


class _ByteCounter:
    """Forwards to the real collective; adds up the bytes handed in over one group."""

    def __init__(self, inner, group):
        self._inner, self._group, self.nbytes = inner, group, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _count(self, tensor, group):
        if group is self._group:
            self.nbytes += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        self._count(tensor, group)
        return self._inner.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        self._count(input, group)
        return self._inner.all_gather(output, input, group=group, async_op=async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, group=None, async_op=False):  # fmt: skip
        self._count(input, group)
        return self._inner.all_to_all(output, input, output_splits, input_splits, group=group, async_op=async_op)  # fmt: skip


def _setup(ctx, layout, cfg, args, onebit: bool):
    model = build_gpt(cfg, layout, ctx.backend, seed=0)[0]
    bucket = int(args.bucket_mb * 2**20 / 4)
    ddp = DataParallel(model, layout, ctx.backend, DataParallelConfig(bucket_size=bucket))
    counter = _ByteCounter(ddp.collective, layout.dp_cp.group)
    ddp.collective = counter
    opt = OneBitAdam(ddp, freeze_step=args.warmup, **HP) if onebit else AdamW(ddp, **HP)
    return ddp, opt, counter


def _step(ddp, opt, counter, tokens, targets, phases, sent):
    t0 = time.perf_counter()
    counter.nbytes = 0
    opt.zero_grad()
    loss = ddp(tokens, targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    ddp.finish_grad_sync()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    sent.append(counter.nbytes)
    return t4 - t0, loss.item()


def _rank_main(ctx, args):
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    cfg = GPTConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
        num_layers=args.layers, seq_len=args.seq,
    )  # fmt: skip
    setups = {name: _setup(ctx, layout, cfg, args, name != "AdamW") for name in CONFIGS}
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    rounds = args.warmup + args.steps
    shape = (rounds, args.batch, args.seq)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=g)
    targets = torch.randint(0, cfg.vocab_size, shape, generator=g)
    times = {n: [] for n in CONFIGS}
    phases = {n: [] for n in CONFIGS}
    sent = {n: [] for n in CONFIGS}
    losses = {}
    for r in range(rounds):
        for name in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            dt, losses[name] = _step(*setups[name], tokens[r], targets[r], phases[name], sent[name])
            if r >= args.warmup:
                times[name].append(dt)
    w = args.warmup
    return {
        "median": {n: statistics.median(t) for n, t in times.items()},
        "phases": {
            n: [statistics.median(x) for x in zip(*p[w:], strict=True)] for n, p in phases.items()
        },
        "bytes": {n: statistics.median(s[w:]) for n, s in sent.items()},
        "warmup_bytes": sent["1-bit Adam"][0],
        "loss": losses,
        "params": sum(p.numel() for p in setups["AdamW"][0].parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="also 1-bit Adam's freeze_step")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    args = p.parse_args()

    ranks = run_ranks(_rank_main, 4, args, timeout_s=1800)
    med = {n: max(r["median"][n] for r in ranks) for n in CONFIGS}
    print(
        f"GPT (llama): {ranks[0]['params'] / 1e6:.2f}M params, {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, {args.batch} seq/rank; 4 ranks gloo (dp=4); "
        f"median of {args.steps} steps after {args.warmup} (1-bit Adam: compression stage)"
    )
    print(
        f"{'config':<12}{'step ms':>9}{'fwd':>8}{'bwd':>8}{'sync':>8}{'optim':>8}{'dp bytes':>12}  loss"
    )
    for name in CONFIGS:
        cols = "".join(f"{x * 1e3:>8.1f}" for x in ranks[0]["phases"][name])
        sent = ranks[0]["bytes"][name]
        print(
            f"{name:<12}{med[name] * 1e3:>9.1f}{cols}{sent:>12,.0f}  {ranks[0]['loss'][name]:.4f}"
        )
    ratio = ranks[0]["bytes"]["1-bit Adam"] / ranks[0]["bytes"]["AdamW"]
    print(f"1-bit Adam warm-up step dp bytes: {ranks[0]['warmup_bytes']:,} (AdamW's)")
    print(f"dp bytes 1-bit / AdamW: {ratio:.4f} (1/{1 / ratio:.1f})")
    print(f"step time 1-bit / AdamW: {med['1-bit Adam'] / med['AdamW']:.3f}")


if __name__ == "__main__":
    main()
