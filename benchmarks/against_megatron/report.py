"""The printout of one configuration (rank 0's result) and the summary table."""

from __future__ import annotations

import statistics
from dataclasses import asdict

from .configs import BATCH, CONFIGS, SEQ, VOCAB, BenchConfig

PHASES = (
    "forward", "backward", "optimizer+rest", "collective wait", "collective calls", "step",
)  # fmt: skip


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _phase_table(phases: dict, names: list[str]) -> None:
    print(f"{'phase ms':<20}" + "".join(f"{s:>16}" for s in names))
    for key in PHASES:
        if not any(key in phases[s] for s in names):
            continue
        scale, fmt = (1, ".0f") if key == "collective calls" else (1e3, ".1f")
        cells = [
            f"{phases[s][key] * scale:>16{fmt}}" if key in phases[s] else f"{'-':>16}"
            for s in names
        ]
        print(f"{key:<20}" + "".join(cells))


def _ops(res: dict, names: list[str], med: dict) -> None:
    for key, label in (
        ("matmul", "matmul ms (profiled)"),
        ("fused attention", "fused attention ms"),
    ):
        print(f"{label:<20}" + "".join(f"{res['ops'][s][key] * 1e3:>16.1f}" for s in names))
    if "gemm_peak" in res:
        peak, flops = res["gemm_peak"], res["weight_flops"]
        print(
            f"weight-product FLOPs: {flops / 1e9:.2f} GFLOP per rank per step at this core's "
            f"{peak / 1e9:.0f} GFLOP/s = {flops / peak * 1e3:.1f} ms"
        )
    floor = res["gemm_floor"]
    print(
        f"GEMM floor (mtcore's {floor['shapes']} product shapes replayed alone, one thread): "
        f"{floor['seconds'] * 1e3:.1f} ms, {floor['flops'] / 1e9:.2f} GFLOP per step"
        + (f" ({floor['unreplayed']:.0f} calls unreadable)" if floor["unreplayed"] else "")
        + "; step / floor: "
        + ", ".join(f"{s} {med[s] / floor['seconds']:.2f}" for s in names)
    )
    for s in names:
        rows = res["op_table"][s]
        print(f"top ops by self CPU, {s} (profiled ms per step, calls per step):")
        for key, sec, calls in rows:
            print(f"  {key:<48} {sec * 1e3:>8.2f} {calls:>7.0f}")


def _cross_entropy(ce: dict) -> None:
    print(f"vocab-parallel cross entropy [{BATCH * SEQ}, {VOCAB // 2}] per rank, ms (median):")
    for part in ("forward", "forward+backward"):
        a, b = ce["mtcore"][part], ce["megatron"][part]
        print(f"  {part:<17} mtcore {a * 1e3:.2f}  megatron {b * 1e3:.2f}  ratio {a / b:.3f}")
    print(f"  max |loss difference| {ce['max |loss difference|']:.2e}")


def report(name: str, res: dict) -> dict:
    t = res["round_times"]
    names = list(t)
    ours = [s for s in names if s != "megatron"]
    med = {s: statistics.median(v) for s, v in t.items()}
    paired = {s: _paired(t[s], t["megatron"]) for s in ours}
    cfg = CONFIGS[name]
    default = BenchConfig(family=cfg.family)
    settings = {"family": cfg.family}
    settings.update({k: v for k, v in asdict(cfg).items() if v != getattr(default, k)})
    print(f"\n## {name}: {settings}")
    if res.get("note"):
        print(
            f"megatron side: DDP + torch AdamW (FP32Optimizer), not its DistributedOptimizer: {res['note']}"
        )
    print(
        "step ms (median of round means): "
        + ", ".join(f"{s} {v * 1e3:.1f}" for s, v in med.items())
    )
    for s in ours:
        rounds = ", ".join(f"{x / y:.3f}" for x, y in zip(t[s], t["megatron"], strict=True))
        print(f"{s} / megatron: paired ratio {paired[s]:.3f} over {len(t[s])} rounds ({rounds})")
    for s, ls in res["losses"].items():
        print(f"loss {s:<15}: " + " ".join(f"{v:.3f}" for v in ls))
    _phase_table(res["phases"], names)
    if "ops" in res:
        _ops(res, names, med)
    if res.get("cross_entropy"):
        _cross_entropy(res["cross_entropy"])
    return {"paired": paired, "ms": {s: v * 1e3 for s, v in med.items()}}


def summary_table(summary: dict) -> None:
    print("\n| config | side | step ms | megatron ms | paired ratio |\n|---|---|---|---|---|")
    for name, s in summary.items():
        for side, ratio in s["paired"].items():
            print(
                f"| {name} | {side} | {s['ms'][side]:.1f} | {s['ms']['megatron']:.1f} | {ratio:.3f} |"
            )
