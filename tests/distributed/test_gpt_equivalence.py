"""The GPT trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's own ``Engine`` (DataParallel, mtcore AdamW or
ZeRO-1, the pipeline runner) for a few steps on the same global batches, fp32,
with gradient clipping active, and is compared with a one-process ``Engine``
run in the test process (``mtcore.testing.equivalence``): the loss of every step,
the gradient norm, the evaluation loss and the final full weights, relative error
<= 1e-5.

2 ranks: tp2, tp2+sp (GPT-2 style: tied, learned positions), pp2, pp2 tied,
dp2, dp2 + ZeRO-1, pp2 with uneven stages (1 + 3 layers, tied). 4 ranks: tp2 x pp2,
tp2 x pp2 x vpp2 + sp (tied, interleaved), pp2 x dp2 + ZeRO-1 (tied), tp2 x dp2 with
full recompute, tp2 x pp2 x vpp2 with 1 + 5 of 6 layers (the first chunk holds only the
embedding, as Llama 3 balanced its pipeline).
"""

from __future__ import annotations

import pytest

from mtcore.models.gpt import GPTConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig

STEPS, BATCH, MB = 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "llama_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **SIZES),
    "llama6": GPTConfig(style="llama", init_std=0.1, **{**SIZES, "num_layers": 6}),
}
# eps=1e-3: the key bias has an exactly-zero gradient (softmax ignores a shift of all
# logits), so its numerical gradient is rounding noise that a tiny eps would turn into
# full-size, layout-dependent Adam updates.
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# The reference takes the same micro-batches as the layouts (gradient accumulation).
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False)  # fmt: skip
# Tied embeddings across pipeline stages are clipped too: the norm counts the last
# stage's copy of the tied weight once (pipeline_copy).
CASES = {
    "tp2": Case(2, "llama", dict(tp=2)),
    "tp2_sp": Case(2, "gpt2", dict(tp=2, sequence_parallel=True)),
    "pp2": Case(2, "llama", dict(pp=2)),
    "pp2_tied": Case(2, "gpt2", dict(pp=2)),
    "dp2": Case(2, "llama", dict(dp=2)),
    "dp2_zero1": Case(2, "gpt2", dict(dp=2), zero1=True),
    "tp2_pp2": Case(4, "llama", dict(tp=2, pp=2)),
    "tp2_pp2_vpp2_sp": Case(4, "gpt2", dict(tp=2, pp=2, vpp=2, sequence_parallel=True)),
    "pp2_dp2_zero1": Case(4, "gpt2", dict(pp=2, dp=2), zero1=True),
    "tp2_dp2_full": Case(4, "llama_full", dict(tp=2, dp=2)),
    "pp2_uneven_tied": Case(2, "gpt2", dict(pp=2, first_stage_layers=1)),
    "tp2_pp2_vpp2_uneven": Case(
        4, "llama6", dict(tp=2, pp=2, vpp=2, first_stage_layers=1, last_stage_layers=5)
    ),
}


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64))


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_one_process(runs, case):
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names={"loss", "lm"})


def test_clipping_was_active(runs):
    """The gradient norms exceed max_grad_norm, so the clipped path is what matched."""
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
