"""Pipeline bubble and step time: mtcore's runner vs torch.distributed.pipelining.

    .venv/bin/python benchmarks/bench_pipeline.py [--pp 2] [--m 4 8 16] [--reps 5]
        [--schedules 1f1b interleaved_1f1b zb_h1]

Each rank (gloo, one thread) holds ``layers / (pp * v)`` MLP blocks per chunk
(hidden -> 4 hidden -> hidden with mtcore's tp=1 linears, whose weight gradients
the zero-bubble schedule defers; matmuls sized so that compute, not transfer,
dominates). mtcore's schedules face torch's: 1f1b Schedule1F1B, interleaved_1f1b
ScheduleInterleaved1F1B, zb_h1 ScheduleInterleavedZeroBubble with one stage per
rank (torch's zero-bubble schedule where the model is the same), interleaved_zb the
same with two. Per configuration both implementations run the same chunks, the
same micro-batches and the same loss, alternating step by step so that both
see the same background load. A step is timed between two barriers; mtcore's
idle share per stage is ``1 - busy / window`` with busy = the runner's
compute time. Noise (a shared 2-core machine): per configuration ``--reps``
steps of each implementation after one warm-up step; the "min" table takes
the least-disturbed step (smallest window, as timeit does), the "median"
table the median step. "simulated": ``simulate`` with every F, B and W taking the
mean time measured for its kind: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1),
ZB-H1 (p-1)(F+B-W) / (m (F+B+W) + (p-1)(F+B-W)). "replay" runs the same action lists through ``simulate`` with the compute
times each rank measured in that step and free transfers: the idle share the
schedule alone explains, given the (noisy, uneven) compute that happened.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

from mtcore.parallel.layout import Axis
from mtcore.testing.distributed import run_ranks


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, tp, generator: torch.Generator):
        from mtcore.parallel.tensor import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.up = ColumnParallelLinear(hidden, 4 * hidden, tp, generator=generator)
        self.down = RowParallelLinear(4 * hidden, hidden, tp, generator=generator)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _cpu_busy(interval: float = 0.5) -> float:
    """Share of the machine's CPU time used (by anyone) over ``interval`` seconds."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def _wait_for_quiet(threshold: float, limit_s: float) -> float:
    """Wait (up to ``limit_s``) until other processes use < ``threshold`` of the
    CPUs; our ranks are blocked in a barrier meanwhile. Returns seconds waited."""
    start = time.perf_counter()
    try:
        while _cpu_busy() > threshold and time.perf_counter() - start < limit_s:
            pass
    except OSError:  # no /proc/stat: no gate
        pass
    return time.perf_counter() - start


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _rank(ctx, cfg):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from mtcore.parallel.layout import LayoutSpec, ParallelLayout
    from mtcore.parallel.pipeline import PipelineGroups, PipelineRunner, build_schedule, stage_plans
    from mtcore.parallel.tensor import TPGroup

    coll = ctx.backend.collective
    layout = ParallelLayout.build(LayoutSpec(pp=cfg["pp"]), coll, ctx.rank, ctx.world_size)
    groups = PipelineGroups.build(layout, coll)
    pp, rank, device = layout.pp, groups.pp_rank, ctx.backend.torch_device()
    mb, seq, hidden = cfg["micro_batch"], cfg["seq"], cfg["hidden"]
    out = []
    torch_schedules = {
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zb_h1": ScheduleInterleavedZeroBubble,
        "interleaved_zb": ScheduleInterleavedZeroBubble,
    }
    for name in cfg["schedules"]:
        v = 2 if name.startswith("interleaved") else 1
        generator, tp = torch.Generator().manual_seed(0), TPGroup.single(ctx.backend)
        blocks = [MLPBlock(hidden, tp, generator) for _ in range(cfg["layers"])]
        chunks = [nn.Sequential(*(blocks[i] for i in p.layers)) for p in stage_plans(cfg["layers"], pp, rank, v)]
        params = [p for c in chunks for p in c.parameters()]
        for m in cfg["m"]:
            if v > 1 and m % pp:
                continue
            g = torch.Generator().manual_seed(m)
            # the input asks for its gradient so that stage 0 computes what the
            # other stages do (otherwise its first matmul's dX is skipped)
            x = torch.randn(m * mb, seq, hidden, generator=g).requires_grad_()
            y = torch.randn(m * mb, seq, hidden, generator=g)
            schedule = build_schedule(name, pp, m, v)
            runner = PipelineRunner(chunks, schedule, groups, ctx.backend, (mb, seq, hidden), _mse, trace=True)
            stages = [
                PipelineStage(c, c_i * pp + rank, pp * v, device, group=layout.group(Axis.PP))
                for c_i, c in enumerate(chunks)
            ]
            kind = torch_schedules[name]
            theirs = kind(stages[0], m, _mse) if kind is Schedule1F1B else kind(stages, m, _mse)

            def run_mtcore(x=x, y=y, runner=runner):
                return runner.step(x.split(mb), y.split(mb))

            def run_torch(x=x, y=y, theirs=theirs):
                if rank == 0:
                    theirs.step(x)
                elif rank == pp - 1:
                    theirs.step(target=y, losses=[])
                else:
                    theirs.step()

            rows = {"mtcore": [], "torch": [], "busy": [], "trace": [], "quiet_wait": []}
            for rep in range(1 + cfg["reps"]):
                order = [("mtcore", run_mtcore), ("torch", run_torch)]
                for impl, fn in order if rep % 2 == 0 else order[::-1]:
                    for p in [*params, x]:
                        p.grad = None
                    if cfg["quiet"] and rank == 0:
                        rows["quiet_wait"].append(_wait_for_quiet(cfg["quiet"], cfg["quiet_limit"]))
                    coll.barrier()
                    t0 = time.perf_counter()
                    stats = fn()
                    coll.barrier()
                    if rep > 0:
                        rows[impl].append(time.perf_counter() - t0)
                        if impl == "mtcore":
                            rows["busy"].append(stats.busy_s)
                            rows["trace"].append([(a, end - start) for a, start, end in stats.trace])
            out.append({"schedule": name, "v": v, "m": m, **rows})
    return out


def _replay(ranks, i, k, pp, v, m, name):
    """Idle share per rank of the schedule run with the compute times measured
    in rep ``k`` and free transfers: what the schedule alone explains."""
    from mtcore.parallel.pipeline import build_schedule, simulate

    cost = {(r, a): d for r, res in enumerate(ranks) for a, d in res[i]["trace"][k]}
    t = simulate(build_schedule(name, pp, m, v), cost=lambda r, a: cost[(r, a)])
    return [t.idle_share(r) for r in range(pp)]


def _simulated(ranks, i, chosen, pp, v, m, name):
    """Mean idle share of the schedule simulated with each kind's mean measured time."""
    from mtcore.parallel.pipeline import build_schedule, simulate

    by_kind = {}
    for res in ranks:
        for k in chosen:
            for a, d in res[i]["trace"][k]:
                by_kind.setdefault(a.kind, []).append(d)
    mean = {kind: statistics.fmean(d) for kind, d in by_kind.items()}
    weight = mean.get("weight", 0.0)
    t = simulate(build_schedule(name, pp, m, v), forward=mean["forward"] * v,
                 backward=(mean["backward"] + weight) * v, weight=weight * v)  # fmt: skip
    return statistics.fmean(t.idle_share(r) for r in range(pp)), mean


def _pick(values, how):
    return min(values) if how == "min" else statistics.median(values)


def _summarise(ranks, pp, how="min"):
    """One row per configuration; ``how`` = "min": the least-disturbed step
    (smallest window, as timeit does), or "median"."""
    lines = [
        "| schedule | p | v | m | F / B / W ms | simulated idle | replay idle per stage | "
        "measured idle per stage | max abs(meas - sim) | mtcore step (s) | torch step (s) | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for i, first in enumerate(ranks[0]):
        name, v, m = first["schedule"], first["v"], first["m"]
        reps = range(len(first["mtcore"]))
        # a step lasts until the slowest rank leaves the closing barrier
        mt_steps = [max(r[i]["mtcore"][k] for r in ranks) for k in reps]
        th_steps = [max(r[i]["torch"][k] for r in ranks) for k in reps]
        least = min(reps, key=mt_steps.__getitem__)
        chosen = [least] if how == "min" else list(reps)
        idle = [
            statistics.median(1 - r[i]["busy"][k] / r[i]["mtcore"][k] for k in chosen) for r in ranks
        ]
        theory, mean = _simulated(ranks, i, chosen, pp, v, m, name)
        times = " / ".join(f"{mean.get(k, 0.0) * 1e3:.1f}" for k in ("forward", "backward", "weight"))
        replays = [_replay(ranks, i, k, pp, v, m, name) for k in chosen]
        replay = [statistics.median(rep[r] for rep in replays) for r in range(pp)]
        mt, th = _pick(mt_steps, how), _pick(th_steps, how)
        dev = max(abs(x - theory) for x in idle)
        lines.append(
            f"| {name} | {pp} | {v} | {m} | {times} | {theory:.3f} | "
            f"{' / '.join(f'{x:.3f}' for x in replay)} | "
            f"{' / '.join(f'{x:.3f}' for x in idle)} | {dev:.3f} ({dev / theory:.0%}) | "
            f"{mt:.3f} | {th:.3f} | {mt / th:.2f} |"
        )
        summary.append(dict(schedule=name, p=pp, v=v, m=m, theory=theory, replay=replay, idle=idle,
                            mtcore_s=mt, torch_s=th, ratio=mt / th, mtcore_steps=mt_steps,
                            torch_steps=th_steps))
    return "\n".join(lines), summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b"],
                    choices=["1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8, help="MLP blocks in the whole model")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--quiet", type=float, default=0.0, metavar="SHARE",
                    help="before each step wait until the machine's CPU use is below SHARE (e.g. 0.25)")
    ap.add_argument("--quiet-limit", type=float, default=20.0, help="longest such wait (s)")
    args = ap.parse_args(argv)
    cfg = dict(pp=args.pp, m=args.m, schedules=args.schedules, reps=args.reps, layers=args.layers, hidden=args.hidden,
               micro_batch=args.micro_batch, seq=args.seq, quiet=args.quiet, quiet_limit=args.quiet_limit)
    start = time.perf_counter()
    ranks = run_ranks(_rank, args.pp, cfg, timeout_s=3600, env={"OMP_NUM_THREADS": "1"})
    waits = [w for row in ranks[0] for w in row["quiet_wait"]]
    print(f"config: {json.dumps(cfg)}; torch {torch.__version__}; {time.perf_counter() - start:.0f} s")
    if waits:
        late = sum(w >= args.quiet_limit for w in waits)
        print(f"quiet gate: waited {sum(waits):.0f} s in all; {late} of {len(waits)} steps started busy")
    out = {"config": cfg}
    for how in ("min", "median"):
        table, out[how] = _summarise(ranks, args.pp, how)
        print(f"\n{how} over {args.reps} steps:\n{table}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
