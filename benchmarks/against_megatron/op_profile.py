"""Operator-level view of a side's step: ``torch.profiler`` self CPU times per op, and
the step's **GEMM floor** measured by replay.

The floor: every matrix product the profiled steps made (``aten::mm``, ``addmm``,
``bmm``, ``baddbmm``, with the shapes the profiler recorded), called again alone on
this rank's one thread with fresh operands of those shapes, the fastest of a few calls
each, summed per step. That is the time the step's forward and backward GEMMs take with nothing else
running; the step divided by it is how far the step is from its matrix products.
Products inside fused attention kernels are not among them (the attention kernel is
reported on its own line).
"""

from __future__ import annotations

import time

import torch

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profile_side(step, batches, record_shapes: bool = False):
    """The profiler run over ``step(batch)`` for every batch (separate steps: the
    profiler slows what it watches, so its times are shares, not the step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        for batch in batches:
            step(batch)
    return prof


def op_times(prof, steps: int) -> dict[str, float]:
    """Seconds per step in matrix products and in fused attention kernels."""
    out = {"matmul": 0.0, "fused attention": 0.0}
    for event in prof.key_averages():
        if event.key in MATMUL_OPS:
            out["matmul"] += event.self_cpu_time_total
        elif "scaled_dot_product" in event.key:
            out["fused attention"] += event.self_cpu_time_total
    return {k: v / 1e6 / steps for k, v in out.items()}


def op_table(prof, steps: int, top: int) -> list[tuple[str, float, float]]:
    """The ``top`` ops by self CPU time: (name, seconds per step, calls per step)."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / 1e6 / steps, e.count / steps) for e in events[:top]]


def _operands(key: str, shapes: list) -> list[torch.Tensor] | None:
    dims = [list(s) for s in shapes if isinstance(s, (list, tuple)) and len(s) >= 1]
    if key in ("aten::mm", "aten::bmm") and len(dims) >= 2:
        return [torch.randn(dims[0]), torch.randn(dims[1])]
    if key in ("aten::addmm", "aten::baddbmm") and len(dims) >= 3:
        return [torch.randn(dims[0]), torch.randn(dims[1]), torch.randn(dims[2])]
    return None


def _replay(key: str, operands: list[torch.Tensor], reps: int) -> float:
    """The fastest of ``reps`` calls (after one warm-up): the product's own time, with
    as little of the other processes' load in it as one thread can get."""
    fn = getattr(torch, key.split("::")[1])
    fn(*operands)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*operands)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_floor(prof, steps: int, reps: int = 7) -> dict:
    """The profiled steps' matrix products replayed alone: seconds per step, FLOPs per
    step, and how many distinct shapes (the calls whose shapes could not be read are
    counted in ``unreplayed``)."""
    seconds = flops = 0.0
    shapes = unreplayed = 0
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in MATMUL_OPS:
            continue
        operands = _operands(event.key, event.input_shapes)
        if operands is None or any(t.numel() == 0 for t in operands):
            unreplayed += event.count
            continue
        a, b = operands[-2], operands[-1]
        batch = a.shape[0] if a.dim() == 3 else 1
        flops += 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1] * event.count
        seconds += _replay(event.key, operands, reps) * event.count
        shapes += 1
    return {
        "seconds": seconds / steps, "flops": flops / steps, "shapes": shapes,
        "unreplayed": unreplayed / steps,
    }  # fmt: skip
