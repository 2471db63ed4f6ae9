"""What one rank runs: build the sides, warm up, alternate timed rounds, then the
instrumented, profiled and cross-entropy extras (rank 0's result is reported)."""

from __future__ import annotations

import statistics
import time

import torch

from .configs import BATCH, CONFIGS, HEADS, HIDDEN, LAYERS, LLAMA_KV_HEADS, SEQ, VOCAB, step_batches
from .instrument import instrument, timed_phases
from .mtcore_side import MtcoreSide, ffn_size
from .op_profile import gemm_floor, op_table, op_times, profile_side


def weight_flops_per_rank(cfg) -> float:
    """FLOPs of one step's weight products on one tp rank of a dense GPT (forward + 2
    backward): ``6 x tokens x weights / tp``, the embedding's lookup excluded."""
    kv = (LLAMA_KV_HEADS if cfg.style == "llama" else HEADS) * (HIDDEN // HEADS)
    attention = HIDDEN * (HIDDEN + 2 * kv) + HIDDEN * HIDDEN
    mlp = (3 if cfg.style == "llama" else 2) * HIDDEN * ffn_size(cfg)
    weights = LAYERS * (attention + mlp) + VOCAB * HIDDEN
    return 6.0 * BATCH * SEQ * weights / cfg.tp


def gemm_peak_flops(reps: int = 30) -> float:
    """This core's fp32 matmul rate, one thread, on the MLP's first product at tp=2."""
    a, b = torch.randn(BATCH * SEQ, HIDDEN), torch.randn(HIDDEN, 4 * HIDDEN // 2)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (time.perf_counter() - t0)


def _cross_entropy_times(ctx, reps: int) -> dict:
    """Both vocab-parallel cross entropies on the same logit shard, alternating."""
    from megatron.core import tensor_parallel

    from mtcore.distributed import LayoutSpec, ParallelLayout
    from mtcore.parallel.tensor import TPGroup, vocab_parallel_cross_entropy

    layout = ParallelLayout.build(
        LayoutSpec(tp=2), ctx.backend.collective, ctx.rank, ctx.world_size
    )
    tp = TPGroup.from_layout(layout, ctx.backend)
    g = torch.Generator().manual_seed(5)
    n = BATCH * SEQ
    logits = torch.randn(n, VOCAB, generator=g).chunk(2, dim=1)[ctx.rank].contiguous()
    target = torch.randint(0, VOCAB, (n,), generator=g)
    sides = {
        "mtcore": lambda x: vocab_parallel_cross_entropy(x, target, tp),
        "megatron": lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target),
    }
    diff = (sides["mtcore"](logits) - sides["megatron"](logits.clone())).abs().max().item()
    out = {name: {"forward": [], "forward+backward": []} for name in sides}
    for i in range(reps + 2):
        for name in sorted(sides, reverse=bool(i % 2)):
            x = logits.clone().requires_grad_(True)
            t0 = time.perf_counter()
            with torch.no_grad():
                sides[name](x.detach().clone())
            t1 = time.perf_counter()
            sides[name](x).sum().backward()
            t2 = time.perf_counter()
            if i >= 2:
                out[name]["forward"].append(t1 - t0)
                out[name]["forward+backward"].append(t2 - t1)
    res = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in out.items()}
    res["max |loss difference|"] = diff
    return res


def _build_sides(ctx, cfg, compare_overlap: bool, compare_shm: bool) -> tuple[dict, str]:
    from .megatron_gpt import LegacyGPTSide
    from .megatron_training import MegatronTrainerSide

    sides = {"mtcore": MtcoreSide(ctx, cfg).step}
    if compare_overlap:  # the same engine twice: overlapped (default) and blocking tp backward
        sides = {
            "mtcore": MtcoreSide(ctx, cfg, overlap="1").step,
            "mtcore-blocking": MtcoreSide(ctx, cfg, overlap="0").step,
        }
    if compare_shm and (cfg.tp > 1 or cfg.dp > 1 or cfg.pp > 1):  # mtcore on gloo, as Megatron
        sides["mtcore-gloo"] = MtcoreSide(ctx, cfg, shm="0").step
    megatron = LegacyGPTSide(cfg) if cfg.legacy else MegatronTrainerSide(cfg)
    sides["megatron"] = megatron.step
    return sides, getattr(megatron, "note", "")


def _rotated(names: list[str], k: int) -> list[str]:
    return names[k % len(names) :] + names[: k % len(names)]


def rank_main(
    ctx, name: str, rounds: int, per_round: int, warmup: int, phase_steps: int, ce_reps: int,
    compare_overlap: bool, profile_steps: int = 0, compare_shm: bool = False,
):  # fmt: skip
    from .cpu_shims import megatron_on_cpu

    torch.set_num_threads(1)
    instrument()
    megatron_on_cpu()
    cfg = CONFIGS[name]
    sides, note = _build_sides(ctx, cfg, compare_overlap, compare_shm)
    total = warmup + rounds * per_round + phase_steps + profile_steps
    batches = step_batches(cfg, total, cfg.dp_rank(ctx.rank))
    losses = {s: [] for s in sides}
    times = {s: [] for s in sides}
    for i in range(warmup):
        for s, step in sides.items():
            losses[s].append(step(batches[i]))
    for r in range(rounds):
        for s in _rotated(list(sides), r):  # who goes first rotates
            spent = 0.0
            for j in range(per_round):
                t0 = time.perf_counter()
                losses[s].append(sides[s](batches[warmup + r * per_round + j]))
                spent += time.perf_counter() - t0
            times[s].append(spent / per_round)
    phases = {s: [] for s in sides}
    for k in range(phase_steps):
        for s in _rotated(list(sides), k):
            phases[s].append(timed_phases(sides[s], batches[warmup + rounds * per_round + k]))
    result = {
        "round_times": times,
        "losses": losses,
        "phases": {
            s: {key: statistics.median(p[key] for p in ps) for key in ps[0]}
            for s, ps in phases.items()
        },
        "note": note,
    }
    if profile_steps and cfg.family == "gpt" and cfg.pp == 1:
        extra = batches[-profile_steps:]
        profiles = {s: profile_side(sides[s], extra, s == "mtcore") for s in sides}
        result["ops"] = {s: op_times(p, len(extra)) for s, p in profiles.items()}
        result["op_table"] = {s: op_table(p, len(extra), 14) for s, p in profiles.items()}
        result["gemm_floor"] = gemm_floor(profiles["mtcore"], len(extra))
        if not cfg.experts:
            result["gemm_peak"] = gemm_peak_flops()
            result["weight_flops"] = weight_flops_per_rank(cfg)
    if cfg.legacy and cfg.tp == 2 and ce_reps:
        result["cross_entropy"] = _cross_entropy_times(ctx, ce_reps)
    return result
