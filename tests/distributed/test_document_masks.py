"""Packed samples with document masks train the same under any layout as in one process.

tests/unit/models/test_document_masks_alone.py shows that, in one process, a packed sample
with ``documents`` and ``positions`` trains each document as if it were alone; here the
layouts match that one process (``mtcore.testing.equivalence``, fp32, relative error
<= 1e-5) on random packings (documents of 1 to 9 tokens, straddling the cp chunks and
ranks): tp2 x pp2 (RoPE), tp2 x pp2 with sequence parallel (GPT-2's learned positions),
cp2 by ring, all-gather and a2a, a sliding window under ring and all-gather, latent
attention under cp2 x tp2, experts under ep2, and full recompute under pp2 x dp2. One
4-rank spawn for the default suite's five cases (tp x pp, every cp method, ep), one
for the rest (``extended``).
"""

from __future__ import annotations

import pytest
import torch

from mtcore.data.documents import DOCUMENTS, POSITIONS, positions_in_documents
from mtcore.models.gpt import GPTConfig
from mtcore.testing.equivalence import (
    Case,
    Setup,
    assert_matches,
    reference,
    spawn,
    token_batches,
)
from mtcore.training.config import OptimizerConfig

WORLD, STEPS, BATCH, MB = 4, 2, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16,
             init_std=0.1)  # fmt: skip
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
MODELS = {
    "llama": GPTConfig(style="llama", **SIZES),
    "gpt2": GPTConfig(style="gpt2", **SIZES),
    "window": GPTConfig(style="llama", sliding_window=5, **SIZES),
    "mla": GPTConfig(**{**SIZES, "num_kv_heads": 4}, mla=MLA),
    "moe": GPTConfig(style="llama", moe=dict(num_experts=4, top_k=2, ffn_size=32), **SIZES),
    "llama_full": GPTConfig(style="llama", recompute="full", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False)  # fmt: skip
DEFAULT_CASES = {
    "tp2_pp2": Case(WORLD, "llama", dict(tp=2, pp=2)),
    "cp2_ring_dp2": Case(WORLD, "llama", dict(cp=2, dp=2, cp_method="ring")),
    "cp2_allgather_tp2": Case(WORLD, "llama", dict(cp=2, tp=2, cp_method="allgather")),
    "cp2_a2a_dp2": Case(WORLD, "llama", dict(cp=2, dp=2, cp_method="a2a")),
    "ep2": Case(WORLD, "moe", dict(ep=2)),
}
EXTENDED_CASES = {
    "tp2_sp_pp2_learned": Case(WORLD, "gpt2", dict(tp=2, pp=2, sequence_parallel=True)),
    "cp2_ring_window": Case(WORLD, "window", dict(cp=2, dp=2, cp_method="ring")),
    "cp2_allgather_window": Case(WORLD, "window", dict(cp=2, dp=2, cp_method="allgather")),
    "mla_cp2_tp2": Case(WORLD, "mla", dict(cp=2, tp=2, cp_method="ring")),
    "pp2_dp2_recompute": Case(WORLD, "llama_full", dict(pp=2, dp=2)),
}


def packed_batches(seed: int = 11) -> list[dict[str, torch.Tensor]]:
    """``token_batches`` with random document boundaries (1 to 9 tokens each), the
    positions within each document, and each document's first half untrained (labels
    -100, as a prompt's are in supervised fine-tuning): micro-batches and dp ranks then
    hold unequal numbers of trained tokens, and the loss is still one process's token
    mean."""
    g = torch.Generator().manual_seed(seed)
    batches = token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64)
    for batch in batches:
        rows = []
        for _ in range(BATCH):
            lengths = []
            while sum(lengths) < SIZES["seq_len"]:
                lengths.append(int(torch.randint(1, 10, (), generator=g)))
            ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            rows.append(ids[: SIZES["seq_len"]])
        batch[DOCUMENTS] = torch.stack(rows)
        batch[POSITIONS] = positions_in_documents(batch[DOCUMENTS])
        lengths = torch.zeros_like(batch[POSITIONS]).scatter_add_(
            1, batch[DOCUMENTS], torch.ones_like(batch[POSITIONS])
        ).gather(1, batch[DOCUMENTS])  # each token's document length
        prompt = 2 * batch[POSITIONS] < lengths - 1
        batch["labels"] = batch["labels"].masked_fill(prompt, -100)
    return batches


def _check(runs, cases, name):
    moe_floor = 1.0 if MODELS[cases[name].model].moe is not None else 1e-6
    assert_matches(SETUP, name, cases[name], *runs[name], eval_names={"loss", "lm"},
                   moe_floor=moe_floor)  # fmt: skip


@pytest.fixture(scope="module")
def default_runs():
    return spawn(SETUP, DEFAULT_CASES, packed_batches())


@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_documents_layout_matches_one_process(default_runs, case):
    _check(default_runs, DEFAULT_CASES, case)


def test_the_reference_sees_the_documents(default_runs):
    """The one process the layouts match trains otherwise without the documents: the
    comparison above would catch a layout that dropped them."""
    blind = [{k: t for k, t in b.items() if k not in (DOCUMENTS, POSITIONS)}
             for b in packed_batches()]  # fmt: skip
    without = reference(SETUP, "llama", blind)
    with_documents = default_runs["tp2_pp2"][1]
    assert abs(without["loss"][0] - with_documents["loss"][0]) > 1e-3 * with_documents["loss"][0]


@pytest.fixture(scope="module")
def extended_runs():
    return spawn(SETUP, EXTENDED_CASES, packed_batches())


@pytest.mark.extended
@pytest.mark.parametrize("case", list(EXTENDED_CASES))
def test_documents_extended_layout_matches_one_process(extended_runs, case):
    _check(extended_runs, EXTENDED_CASES, case)
