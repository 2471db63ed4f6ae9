"""The GPT trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's own ``Engine`` (DataParallel, mtcore AdamW or
ZeRO-1, the pipeline runner) for a few steps on the same global batches, fp32,
with gradient clipping active, and is compared with a one-process ``Engine``
run in the test process: the loss of every step, the gradient norm and the
final full weights, relative error <= 1e-5.

2 ranks: tp2, tp2+sp (GPT-2 style: tied, learned positions), pp2, pp2 tied,
dp2, dp2 + ZeRO-1. 4 ranks: tp2 x pp2, tp2 x pp2 x vpp2 + sp (tied,
interleaved), pp2 x dp2 + ZeRO-1 (tied), tp2 x dp2 with full recompute.
"""

from __future__ import annotations

import io

import pytest
import torch

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.gpt import GPTConfig, lm_batches
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

RTOL = 1e-5
STEPS, BATCH, MB = 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "llama_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **SIZES),
}
# eps=1e-3: the key bias has an exactly-zero gradient (softmax ignores a shift of all
# logits), so its numerical gradient is rounding noise that a tiny eps would turn into
# full-size, layout-dependent Adam updates.
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (world, model, layout, zero1). Tied embeddings across pipeline stages are clipped
# too: the norm counts the last stage's copy of the tied weight once (pipeline_copy).
CASES = {
    "tp2": (2, "llama", dict(tp=2), False),
    "tp2_sp": (2, "gpt2", dict(tp=2, sequence_parallel=True), False),
    "pp2": (2, "llama", dict(pp=2), False),
    "pp2_tied": (2, "gpt2", dict(pp=2), False),
    "dp2": (2, "llama", dict(dp=2), False),
    "dp2_zero1": (2, "gpt2", dict(dp=2), True),
    "tp2_pp2": (4, "llama", dict(tp=2, pp=2), False),
    "tp2_pp2_vpp2_sp": (4, "gpt2", dict(tp=2, pp=2, vpp=2, sequence_parallel=True), False),
    "pp2_dp2_zero1": (4, "gpt2", dict(pp=2, dp=2), True),
    "tp2_dp2_full": (4, "llama_full", dict(tp=2, dp=2), False),
}


def _batches():
    g = torch.Generator().manual_seed(7)
    shape = (STEPS, BATCH, SIZES["seq_len"])
    return torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g)


def _run(engine: Engine, tokens, targets, rows: slice):
    out = {"loss": [], "norm": []}
    for step in range(STEPS):
        x, y = tokens[step][rows].split(MB), targets[step][rows].split(MB)
        result = engine.train_step(lm_batches(x, y))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
    out["eval"] = engine.eval_loss(lm_batches(tokens[0][rows].split(MB), targets[0][rows].split(MB)))
    out["weights"] = engine.full_state_dict()
    return out


def _rank_main(ctx, names, tokens, targets):
    results = {}
    for name in names:
        world, model, layout_kw, zero1 = CASES[name]
        layout = ParallelLayout.build(LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, world)
        dp, dp_rank = layout.size("dp_cp"), layout.coordinate("dp_cp")
        local = BATCH // dp
        engine = Engine(
            MODELS[model],
            layout,
            ctx.backend,
            micro_batch_size=MB,
            num_microbatches=local // MB,
            optimizer=OPT,
            seed=3,
            zero1=zero1,
            bucket_size=700,
        )
        results[name] = _run(engine, tokens, targets, slice(dp_rank * local, (dp_rank + 1) * local))
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _reference(name: str, tokens, targets):
    from mtcore.backend import select_backend

    _, model, _, _ = CASES[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(
            MODELS[model],
            ParallelLayout.single(),
            select_backend("cpu"),
            micro_batch_size=MB,
            num_microbatches=BATCH // MB,
            optimizer=OPT,
            seed=3,
        )
        return _run(engine, tokens, targets, slice(None))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs():
    tokens, targets = _batches()
    out = {}
    for world in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == world]
        ranks = run_ranks(_rank_main, world, names, tokens, targets)
        ranks = [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]
        for name in names:
            out[name] = ([r[name] for r in ranks], _reference(name, tokens, targets))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_one_process(runs, case):
    ranks, ref = runs[case]
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            err = abs(got["loss"][step] - ref["loss"][step]) / abs(ref["loss"][step])
            assert err <= RTOL, f"{case} rank {rank} step {step}: loss {got['loss'][step]} vs {ref['loss'][step]}"
            err = abs(got["norm"][step] - ref["norm"][step]) / ref["norm"][step]
            assert err <= RTOL, f"{case} rank {rank} step {step}: grad norm {got['norm'][step]} vs {ref['norm'][step]}"
        assert abs(got["eval"] - ref["eval"]) / ref["eval"] <= RTOL, (case, got["eval"], ref["eval"])
    weights = ranks[0]["weights"]
    assert weights is not None and set(weights) == set(ref["weights"]), case
    for name, want in ref["weights"].items():
        err = rel_error(weights[name], want)
        assert err <= RTOL, f"{case}: {name} after {STEPS} steps: rel err {err:.2e}"
    assert all(r["weights"] is None for r in ranks[1:]), "only rank 0 gathers the weights"


def test_clipping_was_active(runs):
    """The gradient norms exceed max_grad_norm, so the clipped path is what matched."""
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
