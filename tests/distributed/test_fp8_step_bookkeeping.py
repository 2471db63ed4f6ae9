"""FP8 delayed-scaling bookkeeping batched per step, under tp2 and dp2 (2 ranks).

Counted through a counting wrapper around the collective each FP8 linear reduces its
amaxes with: one all-reduce per step per reduction group (after the first step,
whose first calls are scaled just in time), against 2 x linears x micro-batches per
quantization; the weight quantized once per step per FP8 linear, whatever the number
of micro-batches (also under full recomputation). The losses stay those of
per-quantization bookkeeping (the engine before this change, which the test rebuilds
by handing the linears back): bitwise with one micro-batch per step, where both do
the same arithmetic, and within 1e-2 with several, where each micro-batch used a
scale moved by the previous one and now uses the step's (a different but equally
fine rounding; the bound ``test_fp8_tensor_parallel.py`` gives such differences).
"""

from __future__ import annotations

import pytest
import torch
from counting import CountingCollective

from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.precision.fp8 import FP8Recipe, FP8StepBookkeeping
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

STEPS, BATCH = 5, 8
SIZES = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "llama_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (model, layout, micro-batch size); the micro-batches per step follow from dp
CASES = {
    "tp2_m1": ("llama", dict(tp=2), 8),
    "tp2_m4": ("llama", dict(tp=2), 2),
    "tp2_m4_recompute": ("llama_full", dict(tp=2), 2),
    "dp2_m1": ("llama", dict(dp=2), 4),
    "dp2_m2": ("llama", dict(dp=2), 2),
}


def _engine(ctx, name, per_step: bool):
    model, layout_kw, mb = CASES[name]
    layout = ParallelLayout.build(LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, 2)
    precision = MixedPrecision("fp32", fp8=FP8Recipe("hybrid", "delayed", amax_history_len=4))
    local = BATCH // layout.dp_cp.size
    engine = Engine(
        MODELS[model], layout, ctx.backend, micro_batch_size=mb, num_microbatches=local // mb,
        optimizer=OPT, precision=precision, seed=3,
    )  # fmt: skip
    if not per_step:  # back to bookkeeping at every quantization (the engine before)
        for scaling in engine.fp8.scalings:
            scaling.per_step = False
        engine.fp8 = FP8StepBookkeeping([])
    return engine, layout, mb


def _run(ctx, name, per_step, tokens, targets):
    engine, layout, mb = _engine(ctx, name, per_step)
    scalings = [m for chunk in engine.chunks for m in chunk.modules() if hasattr(m, "per_step")]
    counter = CountingCollective(ctx.backend.collective)
    for scaling in scalings:
        scaling.amax_groups = [(counter, group) for _, group in scaling.amax_groups]
    groups = {"tp": layout.group(Axis.TP), "dp": layout.dp_cp.group}
    local = BATCH // layout.dp_cp.size
    rows = slice(layout.dp_cp.rank * local, (layout.dp_cp.rank + 1) * local)
    out = {"loss": [], "collectives": [], "weight_quantizations": [], "linears": len(scalings)}
    out["microbatches"] = local // mb
    for step in range(STEPS):
        counter.clear()
        before = sum(s.weight_quantizations for s in scalings)
        x, y = tokens[step][rows].split(mb), targets[step][rows].split(mb)
        result = engine.train_step(lm_batches(x, y))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        calls = {k: [c.op for c in counter.on(g)] for k, g in groups.items() if g is not None}
        out["collectives"].append({k: len(v) for k, v in calls.items()})
        assert all(op == "all_reduce" for ops in calls.values() for op in ops)
        out["weight_quantizations"].append(sum(s.weight_quantizations for s in scalings) - before)
    return out


def _rank_main(ctx, tokens, targets):
    return {
        (name, per_step): _run(ctx, name, per_step, tokens, targets)
        for name in CASES
        for per_step in (True, False)
    }


@pytest.fixture(scope="module")
def ranks():
    g = torch.Generator().manual_seed(7)
    shape = (STEPS, BATCH, SIZES["seq_len"])
    tokens, targets = (
        torch.randint(0, 64, shape, generator=g),
        torch.randint(0, 64, shape, generator=g),
    )
    return run_ranks(_rank_main, 2, tokens, targets)


def _group_of(name: str) -> str:
    return "tp" if name.startswith("tp") else "dp"


@pytest.mark.parametrize("case", list(CASES))
def test_one_amax_collective_per_step_and_group(ranks, case):
    for r in ranks:
        batched, per_quantization = r[(case, True)], r[(case, False)]
        linears, m = batched["linears"], batched["microbatches"]
        assert linears >= 8, linears  # qkv, proj, fc1, fc2 in each of 2 blocks
        for step in range(1, STEPS):
            assert batched["collectives"][step].get(_group_of(case)) == 1, batched["collectives"]
            assert sum(batched["collectives"][step].values()) == 1
            # before: input+weight per forward, grad per backward, per linear
            assert per_quantization["collectives"][step][_group_of(case)] == 2 * linears * m
        # The first step scales first calls just in time: one reduction per linear and
        # role, plus the replay of each first input under full recomputation.
        extra = linears if "recompute" in case else 0
        assert batched["collectives"][0][_group_of(case)] == 3 * linears + extra + 1


@pytest.mark.parametrize("case", list(CASES))
def test_weight_quantized_once_per_step_per_linear(ranks, case):
    for r in ranks:
        batched, per_quantization = r[(case, True)], r[(case, False)]
        linears, m = batched["linears"], batched["microbatches"]
        assert batched["weight_quantizations"] == [linears] * STEPS
        passes = 2 if "recompute" in case else 1  # before: the replay quantized it again
        want = [linears * m * passes] * STEPS
        assert per_quantization["weight_quantizations"] == want


@pytest.mark.parametrize("case", list(CASES))
def test_losses_equal_per_quantization_bookkeeping(ranks, case):
    for r in ranks:
        batched, per_quantization = r[(case, True)]["loss"], r[(case, False)]["loss"]
        if r[(case, True)]["microbatches"] == 1:
            assert batched == per_quantization  # the same arithmetic
            continue
        for step, (a, b) in enumerate(zip(batched, per_quantization, strict=True)):
            assert abs(a - b) <= 1e-2 * abs(b), f"{case} step {step}: {a} vs {b}"
