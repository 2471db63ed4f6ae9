"""Zero bubble (B and W split) trains as 1F1B does, for every family that pipelines.

One spawn per world size runs each family's layout twice, under ``1f1b`` and under
``zb_h1`` (with vpp > 1: interleaved 1F1B and ``interleaved_zb``), through the trainer's own ``Engine`` (DataParallel with overlapped
bucket reduction, ZeRO-1 where named, the pipeline runner): the zero-bubble run
matches the one-process reference (``assert_matches``, rel. error <= 1e-5) and
1F1B's run bitwise (every loss, gradient norm and final weight): W computes each
deferred weight gradient with the product an unsplit backward uses and accumulates
the micro-batches in the same order.
"""

from __future__ import annotations

import pytest
import torch
from test_bert_equivalence import MODELS as BERT_MODELS
from test_bert_equivalence import _batches as bert_batches
from test_deepseek_equivalence import MODELS as DEEPSEEK_MODELS
from test_t5_equivalence import MODELS as T5_MODELS
from test_t5_equivalence import _batches as t5_batches
from test_vlm_equivalence import _batches as llava_batches
from test_vlm_equivalence import _model as llava_model

from mtcore.models.gpt import GPTConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig

# Zero bubble is beyond 1F1B and interleaving, which the default suite checks: CI runs
# this file after make test (make test-extended).
pytestmark = pytest.mark.extended

STEPS, BATCH, MB = 2, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MOE = dict(num_experts=4, top_k=2, ffn_size=32, z_loss_coeff=1e-2)
MODELS = {
    "gpt": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "gpt_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **SIZES),
    "gpt2_selective": GPTConfig(style="gpt2", init_std=0.1, recompute="selective", **SIZES),
    "moe": GPTConfig(init_std=0.1, moe=MOE, **SIZES),
    "deepseek_mtp": DEEPSEEK_MODELS["mtp"],  # latent attention, sigmoid experts, MTP
    "bert": BERT_MODELS["nsp"],
    "t5": T5_MODELS["base"],
    "llava": llava_model("base")[0],
}
BATCHES = {
    "gpt": token_batches(STEPS, BATCH, 16, vocab=64),
    "gpt2": token_batches(STEPS, BATCH, 16, vocab=64),
    "gpt_full": token_batches(STEPS, BATCH, 16, vocab=64),
    "gpt2_selective": token_batches(STEPS, BATCH, 16, vocab=64),
    "moe": token_batches(STEPS, BATCH, 16, vocab=64),
    "deepseek_mtp": token_batches(STEPS, BATCH, 16, vocab=64),
    "bert": bert_batches()[:STEPS],
    "t5": t5_batches()[:STEPS],
    "llava": llava_batches("base")[:STEPS],
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False, evaluate=False)  # fmt: skip


def _pair(world: int, model: str, layout: dict, zero1: bool = False) -> dict[str, Case]:
    """The layout under 1F1B (interleaved with vpp > 1) and under zero bubble."""
    name = "_".join([model] + [f"{k}{v}" for k, v in layout.items()]) + ("_zero1" if zero1 else "")
    zero_bubble = "interleaved_zb" if layout.get("vpp", 1) > 1 else "zb_h1"
    return {
        f"{name}_1f1b": Case(world, model, layout, zero1, "1f1b"),
        f"{name}_zb": Case(world, model, layout, zero1, zero_bubble),
    }


PAIRS = [
    (2, "gpt", dict(pp=2)),
    (2, "gpt2", dict(pp=2)),  # tied embedding across stages
    (2, "gpt_full", dict(pp=2)),  # recompute: the layers run forward again inside B
    (2, "gpt2_selective", dict(pp=2)),
    (2, "bert", dict(pp=2)),
    (2, "t5", dict(pp=2)),
    (2, "llava", dict(pp=2)),
    (2, "moe", dict(pp=2)),
    (2, "deepseek_mtp", dict(pp=2)),  # MLA's replicated down-projections defer too
    (2, "gpt2", dict(pp=2, vpp=2)),  # interleaved_zb from here on
    (2, "bert", dict(pp=2, vpp=2)),
    (2, "t5", dict(pp=2, vpp=2)),
    (2, "llava", dict(pp=2, vpp=2)),
    (2, "moe", dict(pp=2, vpp=2)),
    (4, "gpt", dict(pp=2, vpp=2, dp=2), True),
    (4, "gpt", dict(pp=4)),
    (4, "gpt2", dict(pp=2, dp=2), True),  # dp overlap + ZeRO-1
    (4, "gpt", dict(pp=2, tp=2, sequence_parallel=True)),
    (4, "moe", dict(pp=2, ep=2)),
    (4, "bert", dict(pp=4)),
    (4, "t5", dict(pp=4)),
    (4, "llava", dict(pp=4)),
    (4, "moe", dict(pp=4)),
]
CASES = {name: case for pair in PAIRS for name, case in _pair(*pair).items()}
ZB = [name for name in CASES if name.endswith("_zb")]


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, BATCHES)


@pytest.mark.parametrize("case", ZB)
def test_zero_bubble_matches_one_process_and_1f1b_bitwise(runs, case):
    ranks, ref = runs[case]
    assert_matches(SETUP, case, CASES[case], ranks, ref, moe_floor=1.0)
    twin, _ = runs[case.removesuffix("_zb") + "_1f1b"]
    for rank, (got, want) in enumerate(zip(ranks, twin, strict=True)):
        assert got["loss"] == want["loss"], (case, rank, got["loss"], want["loss"])
        assert got["norm"] == want["norm"], (case, rank, got["norm"], want["norm"])
    got, want = ranks[0]["weights"], twin[0]["weights"]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (case, name)
