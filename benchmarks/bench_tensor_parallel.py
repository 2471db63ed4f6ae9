"""mtcore tensor parallel against PyTorch's own, side by side, on 2 gloo ranks.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--steps 30 --warmup 5]

Both sides train the *same* block on the same batch from the same weights:
mtcore's is a block of the GPT family's model (``mtcore.models.gpt``, Llama style:
fused QKV and fused gate/up column-parallel, row-parallel outputs); PyTorch's is a plain
``nn.Module`` with separate q/k/v/gate/up/down ``nn.Linear`` layers, sharded by
``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel /
RowwiseParallel on ``DeviceMesh("cpu", [0, 1])`` (torchtitan's Llama plan).
Both call the same kernel functions (mtcore's reference rms_norm, rope and
attention) so only the tensor-parallel machinery differs. The script checks that
both give the same output before timing.

A step is zero_grad + forward + backward (+ SGD step: ``--with-optimizer``).
The two implementations alternate step by step, so load from other processes
on the machine hits both alike. Reported: median step time of rank 0 after
warmup, the ratio of the medians mtcore / torch (target <= 1.0), and the
median of the per-iteration ratios (each pair ran back to back, so it is the
figure least moved by other load on the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

CONFIG = GPTConfig(
    vocab_size=64, hidden_size=512, num_heads=8, num_kv_heads=4, ffn_hidden_size=1536,
    num_layers=1, seq_len=256,
)  # fmt: skip
BATCH = 4


class TorchMLP(nn.Module):
    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(h, ffn, bias=False)  # gate
        self.w3 = nn.Linear(h, ffn, bias=False)  # up
        self.w2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TorchRMSNorm(nn.Module):
    def __init__(self, cfg: GPTConfig, kernels):
        super().__init__()
        self.eps, self.kernels = cfg.norm_eps, kernels
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x):
        return self.kernels.rms_norm(x, self.weight, self.eps)


class TorchAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, kernels):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.kernels, self.d = kernels, d
        self.wq = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.wk = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.wv = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, y, cos, sin):
        k_, b, s = self.kernels, y.shape[0], y.shape[1]
        q = k_.rope(self.wq(y).view(b, s, -1, self.d), cos, sin).transpose(1, 2)  # local heads
        k = k_.rope(self.wk(y).view(b, s, -1, self.d), cos, sin).transpose(1, 2)
        v = self.wv(y).view(b, s, -1, self.d).transpose(1, 2)
        o = k_.attention(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class TorchBlock(nn.Module):
    """The GPT block written the way torchtitan writes Llama; ``rope`` is ``(cos, sin)``."""

    def __init__(self, cfg: GPTConfig, kernels):
        super().__init__()
        self.attn_norm, self.attn = TorchRMSNorm(cfg, kernels), TorchAttention(cfg, kernels)
        self.mlp_norm, self.mlp = TorchRMSNorm(cfg, kernels), TorchMLP(cfg.hidden_size, cfg.ffn_size)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), *rope)
        return x + self.mlp(self.mlp_norm(x))


def _torch_state(full: dict, cfg: GPTConfig) -> dict:
    """mtcore's full (unsharded) block weights under the torch module's names."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    wq, wk, wv = full["attn.qkv.weight"].split([q, kv, kv])
    w1, w3 = full["mlp.fc1.weight"].split([f, f])
    return {
        "attn_norm.weight": full["attn_norm.weight"],
        "attn.wq.weight": wq,
        "attn.wk.weight": wk,
        "attn.wv.weight": wv,
        "attn.wo.weight": full["attn.proj.weight"],
        "mlp_norm.weight": full["mlp_norm.weight"],
        "mlp.w1.weight": w1,
        "mlp.w3.weight": w3,
        "mlp.w2.weight": full["mlp.fc2.weight"],
    }


def _torch_plan(prefix: str, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sp else Replicate()
    plan = {
        f"{prefix}w1": ColwiseParallel(),
        f"{prefix}w3": ColwiseParallel(),
        f"{prefix}w2": RowwiseParallel(output_layouts=out),
    }
    if prefix:  # the whole block (torchtitan's Llama plan)
        plan.update(
            {
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=out),
            }
        )
        if sp:
            gather = (Shard(1),), (Replicate(),)
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "mlp_norm": SequenceParallel(),
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=gather[0], desired_input_layouts=gather[1]
                    ),
                }
            )
    return plan


def _workloads(ctx, layouts):
    """name -> (mtcore module, torch module, call(module, x), mtcore finalize, sp).

    layouts: sequence parallel (bool) -> the tp=2 layout.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mtcore.parallel.tensor import allreduce_sequence_parallel_grads, full_tensors

    mesh = DeviceMesh("cpu", [0, 1])
    out = {}
    cfg = CONFIG
    for name, sp in (("mlp", False), ("block", False), ("block+sp", True)):
        (model,) = build_gpt(cfg, layouts[sp], ctx.backend, seed=0)
        block = model.layers["0"]
        full = {
            k[9:]: v for k, v in full_tensors(model, model.tp).items() if k.startswith("layers.0.")
        }
        state = _torch_state(full, cfg)
        rope = model.rope
        if name == "mlp":
            ours, theirs = block.mlp, TorchMLP(cfg.hidden_size, cfg.ffn_size)
            theirs.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("mlp.")})
            parallelize_module(theirs, mesh, _torch_plan("", False))
            call = lambda m, x: m(x)  # noqa: E731
        else:
            ours, theirs = block, TorchBlock(cfg, ctx.backend.kernels)
            theirs.load_state_dict(state)
            parallelize_module(theirs, mesh, _torch_plan("mlp.", sp))
            call = lambda m, x, rope=rope: m(x, rope)  # noqa: E731
        tp = model.tp
        finalize = (lambda m=ours, tp=tp: allreduce_sequence_parallel_grads(m, tp)) if sp else None
        out[name] = (ours, theirs, call, finalize, sp)
    return out


def _rank_main(ctx, steps: int, warmup: int, with_optimizer: bool, only: list[str] | None):
    layouts = {
        sp: ParallelLayout.build(
            LayoutSpec(tp=2, sequence_parallel=sp), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        for sp in (False, True)
    }
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(BATCH, CONFIG.seq_len, CONFIG.hidden_size, generator=g)
    probe_full = torch.randn(BATCH, CONFIG.seq_len, CONFIG.hidden_size, generator=g)
    results = {}
    for name, (ours, theirs, call, finalize, sp) in _workloads(ctx, layouts).items():
        if only and name not in only:
            continue
        # Under sequence parallel a block takes and returns this rank's sequence shard.
        x, probe = (t.chunk(2, dim=1)[ctx.rank] if sp else t for t in (x_full, probe_full))
        opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (ours, theirs)}

        def step(m, call=call, opts=opts, x=x, probe=probe, finalize=finalize, ours=ours):
            opt = opts[id(m)]
            opt.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out = call(m, xi)
            (out * probe).mean().backward()
            if finalize is not None and m is ours:
                finalize()  # sum the norm-weight grads over tp (torch's SP does it in backward)
            if with_optimizer:
                opt.step()
            return out.detach()

        a, b = step(ours), step(theirs)
        same = ((a - b).norm() / b.norm()).item()
        times = {"mtcore": [], "torch": []}
        for i in range(warmup + steps):
            for label, m in (
                (("mtcore", ours), ("torch", theirs))
                if i % 2
                else (("torch", theirs), ("mtcore", ours))
            ):
                t0 = time.perf_counter()
                step(m)
                if i >= warmup:
                    times[label].append(time.perf_counter() - t0)
        paired = [p / q for p, q in zip(times["mtcore"], times["torch"], strict=True)]
        results[name] = {
            "output_rel_diff": same,
            **{k: statistics.median(v) for k, v in times.items()},
            "paired_ratio": statistics.median(paired),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--with-optimizer", action="store_true", help="include an SGD step")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", nargs="*", help="workloads: mlp block block+sp")
    args = parser.parse_args()
    res = run_ranks(
        _rank_main, 2, args.steps, args.warmup, args.with_optimizer, args.only, timeout_s=1800
    )[0]
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(
        "tp=2 (torch TP on gloo, mtcore's tp group through shared memory), 1 thread/rank, "
        f"fp32, batch {BATCH} x seq {CONFIG.seq_len}, "
        f"hidden {CONFIG.hidden_size}, heads {CONFIG.num_heads}/{CONFIG.kv_heads}, "
        f"ffn {CONFIG.ffn_size}; median of {args.steps} steps "
        f"after {args.warmup} warmup; step = fwd + bwd{' + SGD' if args.with_optimizer else ''}"
    )
    print(
        "| workload | mtcore ms | torch TP ms | mtcore / torch | paired ratio | output rel diff |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(
            f"| {name} | {r['mtcore'] * 1e3:.1f} | {r['torch'] * 1e3:.1f} | "
            f"{r['mtcore'] / r['torch']:.3f} | {r['paired_ratio']:.3f} | {r['output_rel_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
