"""MoE token dispatch: all-to-all (plain, deduplicated) against all-gather, at ep=2 and 4.

    .venv/bin/python benchmarks/bench_moe_dispatch.py              # 4 ranks, gloo

One launch of 4 ranks (gloo, one thread per rank). Two layouts share it:
ep=4 (one expert group of 4 ranks) and ep=2 (dp=4: two expert groups of 2
ranks, running at the same time, as in training). For every top-k in
``--top-k`` and each dispatcher (``alltoall``: one row per assignment;
``alltoall_dedup``: one row per token and destination rank; ``allgather``),
a round times on each rank:

* fwd: ``dispatch`` + ``combine`` of a micro-batch (routing is precomputed;
  the experts are replaced by the identity so only data movement and the
  sort/scatter bookkeeping are timed);
* fwd+bwd: the same plus the backward of ``combine(dispatch(x))`` (the
  reverse collectives).

Configurations run interleaved, one each per round, after a barrier, so load
from other jobs hits them alike; each reports the median over ``--steps``
rounds of the slowest rank. Output: times and the ratios all-to-all /
all-gather (< 1: all-to-all is faster). Before timing, the dispatchers'
outputs are checked equal (they must be: same routing, same weights).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.moe import DISPATCHERS, MoESpec, ep_group, route
from mtcore.testing.distributed import run_ranks

DISPATCH = ("alltoall", "alltoall_dedup", "allgather")


def _routing(args, top_k, rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    spec = MoESpec(num_experts=args.experts, top_k=top_k, ffn_size=1)
    r = route(logits, spec)
    return x, r.experts, r.probs


def _time_one(dispatcher, x, experts, probs, backward: bool, collective) -> float:
    collective.barrier()
    t0 = time.perf_counter()
    xi = x.requires_grad_(backward)
    rows, _ = dispatcher.dispatch(xi, experts, probs, None)
    y = dispatcher.combine(rows)
    if backward:
        y.backward(torch.ones_like(y))
    return time.perf_counter() - t0


def _rank_main(ctx, args):
    torch.manual_seed(0)
    collective = ctx.backend.collective
    groups = {}
    for ep in (2, 4):
        layout = ParallelLayout.build(LayoutSpec(ep=ep), collective, ctx.rank, ctx.world_size)
        groups[ep] = ep_group(layout, ctx.backend)
    configs = [
        (ep, k, name, bwd)
        for ep in (2, 4)
        for k in args.top_k
        for name in DISPATCH
        for bwd in (False, True)
    ]
    data = {k: _routing(args, k, ctx.rank) for k in args.top_k}
    agree = {}
    for ep in (2, 4):
        for k in args.top_k:
            x, experts, probs = data[k]
            outs = []
            for name in DISPATCH:
                d = DISPATCHERS[name](args.experts, groups[ep])
                outs.append(d.combine(d.dispatch(x, experts, probs, None)[0]))
            agree[(ep, k)] = all(torch.allclose(o, outs[0], rtol=1e-5, atol=1e-6) for o in outs[1:])
    times = {c: [] for c in configs}
    for r in range(args.warmup + args.steps):
        shift = r % len(configs)
        for c in configs[shift:] + configs[:shift]:
            ep, k, name, bwd = c
            x, experts, probs = data[k]
            d = DISPATCHERS[name](args.experts, groups[ep])
            dt = _time_one(d, x.detach().clone(), experts, probs, bwd, collective)
            if r >= args.warmup:
                times[c].append(dt)
    return {"times": times, "agree": agree}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per micro-batch")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    ranks = run_ranks(_rank_main, 4, args, timeout_s=1800)
    configs = list(ranks[0]["times"])
    med = {
        c: statistics.median(max(rk["times"][c][i] for rk in ranks) for i in range(args.steps))
        for c in configs
    }
    agree = all(all(rk["agree"].values()) for rk in ranks)
    print(
        f"4 ranks gloo; {args.tokens} tokens x hidden {args.hidden} fp32 per rank, "
        f"{args.experts} experts; median of {args.steps} rounds, slowest rank; "
        f"dispatchers agree: {agree}"
    )
    print(
        f"{'ep':>3}{'top-k':>6}{'pass':>9}{'a2a ms':>9}{'dedup ms':>10}{'ag ms':>9}"
        f"{'a2a / ag':>10}{'dedup / ag':>12}"
    )
    for ep in (2, 4):
        for k in args.top_k:
            for bwd in (False, True):
                a2a, dd, ag = (med[(ep, k, name, bwd)] for name in DISPATCH)
                print(
                    f"{ep:>3}{k:>6}{'fwd+bwd' if bwd else 'fwd':>9}{a2a * 1e3:>9.1f}"
                    f"{dd * 1e3:>10.1f}{ag * 1e3:>9.1f}{a2a / ag:>10.3f}{dd / ag:>12.3f}"
                )


if __name__ == "__main__":
    main()
