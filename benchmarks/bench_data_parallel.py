"""mtcore data parallel against PyTorch's, side by side: DP vs DDP, ZeRO-1 vs FSDP2.

    .venv/bin/python benchmarks/bench_data_parallel.py            # 2 ranks, gloo

Target (issue 3): step-time ratio mtcore / torch <= 1.0 for both pairs.

All four run in one launch of 2 ranks (gloo, one thread per rank), on copies
of the same GPT (``mtcore.models.gpt``, Llama style, tp=1, fp32) with
the same batches, the same AdamW settings (decay / no-decay groups) and the
same bucket size. A step is zero_grad + forward + backward + gradient sync +
optimizer step (ZeRO-1 and FSDP2 include their parameter all-gathers). The
four configurations run interleaved, one step each per round, so machine noise
hits them alike; each reports the median of ``--steps`` rounds after
``--warmup``, slowest rank. The final losses are printed too: the four run
the same arithmetic, so they agree to fp32 rounding.

Peers: ``torch.nn.parallel.DistributedDataParallel`` (bucket_cap_mb = the
same bucket size) and FSDP2 ``fully_shard`` per block and at the root on a CPU
DeviceMesh, ``reshard_after_forward=False`` (params stay gathered between
forward and backward, closest to ZeRO-1/2), each with ``torch.optim.AdamW``
(``--torch-adamw``: default = what torch picks on CPU, or foreach / fused).

Columns: "step ms" is the slowest rank's median step; the phases are rank 0's
medians: fwd (zero_grad + forward; FSDP2 all-gathers params here), bwd
(backward, including DDP's and FSDP2's in-backward reductions), sync (mtcore's
``finish_grad_sync`` wait) and optim (``step()``; ZeRO-1 all-gathers params here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.optimizer import AdamW, DistributedAdamW
from mtcore.testing.distributed import run_ranks

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = ("mtcore DP", "torch DDP", "mtcore ZeRO-1", "torch FSDP2")


def _torch_adamw(params, flavour: str):
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": HP["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = (
        {"foreach": True} if flavour == "foreach" else {"fused": True} if flavour == "fused" else {}
    )
    return torch.optim.AdamW(groups, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], **kwargs)


def _setups(ctx, layout, cfg: GPTConfig, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    bucket = int(args.bucket_mb * 2**20 / 4)
    model = lambda: build_gpt(cfg, layout, ctx.backend, seed=0)[0]  # noqa: E731
    setups = {}

    dp = DataParallel(model(), layout, ctx.backend, DataParallelConfig(bucket_size=bucket))
    setups["mtcore DP"] = (dp, AdamW(dp, **HP))

    ddp = DistributedDataParallel(model(), bucket_cap_mb=args.bucket_mb)
    setups["torch DDP"] = (ddp, _torch_adamw(list(ddp.parameters()), args.torch_adamw))

    cfg_zero = DataParallelConfig(bucket_size=bucket, shard_optimizer=True)
    zero = DataParallel(model(), layout, ctx.backend, cfg_zero)
    setups["mtcore ZeRO-1"] = (zero, DistributedAdamW(zero, **HP))

    fsdp = model()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in fsdp.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(fsdp, mesh=mesh, reshard_after_forward=False)
    setups["torch FSDP2"] = (fsdp, _torch_adamw(list(fsdp.parameters()), args.torch_adamw))
    return setups


def _step(name, module, opt, tokens, targets, phases):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = module(tokens, targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if name.startswith("mtcore"):
        module.finish_grad_sync()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    return t4 - t0, loss.item()


def _rank_main(ctx, args):
    torch.manual_seed(0)
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        ffn_hidden_size=args.ffn,
        num_layers=args.layers,
        seq_len=args.seq,
    )
    setups = _setups(ctx, layout, cfg, args)
    g = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own half of the batch
    rounds = args.warmup + args.steps
    shape = (rounds, args.batch, args.seq)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=g)
    targets = torch.randint(0, cfg.vocab_size, shape, generator=g)
    times = {name: [] for name in CONFIGS}
    phases = {name: [] for name in CONFIGS}
    losses = {}
    for r in range(rounds):
        order = CONFIGS[r % 4 :] + CONFIGS[: r % 4]  # rotate who goes first
        for name in order:
            module, opt = setups[name]
            dt, losses[name] = _step(name, module, opt, tokens[r], targets[r], phases[name])
            if r >= args.warmup:
                times[name].append(dt)
    n_params = sum(p.numel() for p in setups["mtcore DP"][0].parameters())
    med = {n: statistics.median(t) for n, t in times.items()}
    ph = {
        n: [statistics.median(x) for x in zip(*p[args.warmup :], strict=True)]
        for n, p in phases.items()
    }
    return {"median": med, "phases": ph, "loss": losses, "params": n_params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=4.0, help="fp32 MB per bucket, both sides")
    p.add_argument("--torch-adamw", choices=("default", "foreach", "fused"), default="default")
    args = p.parse_args()

    ranks = run_ranks(_rank_main, 2, args, timeout_s=1800)
    med = {n: max(r["median"][n] for r in ranks) for n in CONFIGS}
    print(
        f"GPT (llama): {ranks[0]['params'] / 1e6:.2f}M params, {args.layers} layers, hidden "
        f"{args.hidden}, seq {args.seq}, {args.batch} seq/rank; 2 ranks gloo; bucket "
        f"{args.bucket_mb} MB; torch AdamW {args.torch_adamw}; median of {args.steps} steps"
    )
    print(f"{'config':<15}{'step ms':>9}{'fwd':>8}{'bwd':>8}{'sync':>8}{'optim':>8}  final loss")
    for name in CONFIGS:
        phases = ranks[0]["phases"][name]
        cols = "".join(f"{x * 1e3:>8.1f}" for x in phases)
        print(f"{name:<15}{med[name] * 1e3:>9.1f}{cols}  {ranks[0]['loss'][name]:.6f}")
    dp_ratio = med["mtcore DP"] / med["torch DDP"]
    zero_ratio = med["mtcore ZeRO-1"] / med["torch FSDP2"]
    print(f"ratio mtcore DP / torch DDP:       {dp_ratio:.3f}")
    print(f"ratio mtcore ZeRO-1 / torch FSDP2: {zero_ratio:.3f}")


if __name__ == "__main__":
    main()
