"""A DeepSeek-style GPT (multi-head latent attention, a dense first layer, shared and
group-limited sigmoid-routed experts with a routed scale and aux-loss-free biases) trains
the same under every layout as in one process (gloo, one spawn of 4 ranks).

The shared harness (``mtcore.testing.equivalence``) runs the trainer's ``Engine`` for
two steps, fp32, with clipping, against a one-process ``Engine`` on the same
micro-batches: losses, gradient norms, MoE loads, the first step's full gradients and
the final weights (expert biases included), relative error <= 1e-5. Layouts:

* ``tp2_sp_pp2``: latent attention's heads over tp with sequence parallel (the
  replicated down-projections see sequence shards), two pipeline stages;
* ``ep2_tp2``: experts over ep, each expert and the heads over tp;
* ``ep2_zero1``: dp4 with ZeRO-1 (expert state over the ep pairs' edp);
* ``cp2_tp2``: the sequence over cp (ring attention over the padded heads);
* ``pp2_vpp2_dp2``: interleaved pipeline, one layer per virtual stage;
* ``pp2_dp2_recompute``, ``tp2_dp2_selective``: full recompute of each block
  (pipeline by data parallel), selective recompute of the attention core;
* multi-token prediction (two modules, each a MoE block; model ``mtp``) under ep2 x
  tp2 with sequence parallel, ep2 with ZeRO-1 and pp2 x ep2 (the embedding's copy on
  the last stage, its gradient summed with the first stage's): its ``mtp_k`` loss terms are compared like the main one;
* a Qwen3-MoE-shaped model (QK-norm on grouped-query heads, softmax experts, a dense
  first layer) under ep2 x tp2 with sequence parallel and under tp2 x pp2;
* (extended, 8 ranks in one spawn) DeepSeek's ``first_k_dense_replace`` 1 and 3
  (V3/R1's) under tp2 x pp2 x ep2: with 3 the first stage is all dense and the second
  holds a dense layer before the MoE one (issue 47).
"""

from __future__ import annotations

import pytest

from mtcore.models.gpt import GPTConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig

WORLD, STEPS, BATCH, MB = 4, 2, 8, 2
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
MOE = dict(
    num_experts=8,
    top_k=2,
    ffn_size=16,
    shared_ffn_size=16,
    score="sigmoid",
    expert_groups=4,
    top_groups=2,
    routed_scale=2.0,
    bias_update_rate=1e-2,
    aux_loss="seq",
    aux_loss_coeff=1e-2,
)
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, seq_len=16, init_std=0.1)
DEEPSEEK = dict(SIZES, mla=MLA, moe=MOE, first_dense_layers=1, ffn_hidden_size=48)
MODELS = {
    "deepseek": GPTConfig(**DEEPSEEK),
    "recompute": GPTConfig(**DEEPSEEK, recompute="full"),
    "selective": GPTConfig(**DEEPSEEK, recompute="selective"),
    "mtp": GPTConfig(**DEEPSEEK, mtp=dict(depth=2, loss_weight=0.5)),
    # Qwen3-MoE-shaped: grouped-query heads with QK-norm, softmax experts, a dense first layer
    "qwen3_moe": GPTConfig(
        **SIZES,
        num_kv_heads=2,
        qk_norm=True,
        first_dense_layers=1,
        moe=dict(num_experts=4, top_k=2, ffn_size=16),
    ),
}
DENSE_FIRST = {  # DeepSeek-V3/R1 keep 3 dense layers; with 4 layers over pp2, one stage is dense
    f"dense_{k}": GPTConfig(**{**DEEPSEEK, "first_dense_layers": k}) for k in (1, 3)
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
CASES = {
    "tp2_sp_pp2": Case(WORLD, "deepseek", dict(tp=2, pp=2, sequence_parallel=True)),
    "ep2_tp2": Case(WORLD, "deepseek", dict(ep=2, tp=2)),
    "ep2_zero1": Case(WORLD, "deepseek", dict(ep=2), zero1=True),
    "cp2_tp2": Case(WORLD, "deepseek", dict(cp=2, tp=2)),
    "pp2_dp2_recompute": Case(WORLD, "recompute", dict(pp=2)),
    "pp2_vpp2_dp2": Case(WORLD, "deepseek", dict(pp=2, vpp=2)),  # the dense layer alone
    "tp2_dp2_selective": Case(WORLD, "selective", dict(tp=2)),
    "mtp_ep2_tp2_sp": Case(WORLD, "mtp", dict(ep=2, tp=2, sequence_parallel=True)),
    "mtp_dp4_zero1": Case(WORLD, "mtp", dict(ep=2), zero1=True),
    "mtp_pp2_ep2": Case(WORLD, "mtp", dict(pp=2, ep=2)),  # the embedding's copy on stage 2
    "qwen3_moe_ep2_tp2_sp": Case(WORLD, "qwen3_moe", dict(ep=2, tp=2, sequence_parallel=True)),
    "qwen3_moe_tp2_pp2": Case(WORLD, "qwen3_moe", dict(tp=2, pp=2)),
}
DENSE_FIRST_CASES = {
    f"{name}_tp2_pp2_ep2": Case(8, name, dict(tp=2, pp=2, ep=2)) for name in DENSE_FIRST
}
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5,
              reference_micro_batch_size=MB, evaluate=False)  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64))


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_layout_matches_one_process(runs, case):
    assert_matches(SETUP, case, CASES[case], *runs[case], moe_floor=1.0)


DENSE_SETUP = Setup(DENSE_FIRST, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5,
                    reference_micro_batch_size=MB, evaluate=False)  # fmt: skip


@pytest.fixture(scope="module")
def dense_first_runs():
    batches = token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64)
    return spawn(DENSE_SETUP, DENSE_FIRST_CASES, batches)


@pytest.mark.extended
@pytest.mark.parametrize("case", list(DENSE_FIRST_CASES))
def test_dense_first_layers_match_one_process_under_tp2_pp2_ep2(dense_first_runs, case):
    records, reference = dense_first_runs[case]
    assert_matches(DENSE_SETUP, case, DENSE_FIRST_CASES[case], records, reference, moe_floor=1.0)
    dense = DENSE_FIRST[DENSE_FIRST_CASES[case].model].first_dense_layers
    weights = reference["weights"]  # the reference is built with the dense layers first
    assert all(f"layers.{i}.mlp.fc1.weight" in weights for i in range(dense))
    assert all(f"layers.{i}.mlp.router.weight" in weights for i in range(dense, 4))


def test_reference_exercises_the_deepseek_paths(runs):
    """Clipping was on, the aux-loss-free biases moved, and the loads were uneven."""
    ref = runs["ep2_tp2"][1]
    assert min(ref["norm"]) > OPT.max_grad_norm
    assert ref["weights"]["layers.1.mlp.router.expert_bias"].abs().max() > 0
    assert "layers.0.mlp.fc1.weight" in ref["weights"]  # layer 0 is dense
    assert max(s["load_max"] for s in ref["moe"]) > 1.0


def test_reference_trains_the_prediction_modules(runs):
    ref = runs["mtp_ep2_tp2_sp"][1]
    assert {"mtp_1", "mtp_2"} <= set(ref["terms"][0]), ref["terms"][0]
    assert "mtp.1.block.mlp.experts.fc1" in ref["weights"]
