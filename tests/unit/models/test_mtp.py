"""Multi-token prediction (``model.mtp``) in one process: module k's logits at position i
see the tokens up to i + k and predict ``labels[i + k]``; its loss term counts those
targets; layouts it does not support and HF export are refused."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import FAMILY, GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import HFInteropError, export_hf
from mtcore.parallel.layout import LayoutError, LayoutSpec

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SEQ = 12
CONFIG = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=SEQ, init_std=0.1,
    mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    moe=dict(num_experts=4, top_k=2, ffn_size=16, score="sigmoid"), first_dense_layers=1,
    mtp=dict(depth=2, loss_weight=0.4),
)  # fmt: skip


def _model() -> GPT:
    return GPT(CONFIG, single_context(CONFIG, select_backend("cpu"))).eval()


def _batch(seed: int) -> dict:
    t = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": t[:, :-1].clone(), "labels": t[:, 1:].clone()}


def test_module_k_sees_tokens_up_to_i_plus_k():
    model, batch = _model(), _batch(1)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["tokens"][:, 8] = (changed["tokens"][:, 8] + 1) % 64  # token 8 differs
    with torch.no_grad():
        a, b = model.stage({}, batch), model.stage({}, changed)
    for k, name in ((0, "logits"), (1, "mtp_1"), (2, "mtp_2")):
        same = (a[name] - b[name]).abs().amax(dim=(0, 2)) == 0
        # position i reads tokens <= i + k: the first 8 - k positions are unchanged
        assert same[: 8 - k].all() and not same[8 - k], (name, same)


def test_terms_count_their_targets_and_weigh_loss_weight_over_depth():
    model, batch = _model(), _batch(2)
    batch["labels"][0, 5] = -100
    with torch.no_grad():
        terms = model.loss(model.stage({}, batch), batch)
    counts = FAMILY.loss_counts(CONFIG, batch)
    assert {k: int(v) for k, v in counts.items()} == {"lm": 23, "mtp_1": 21, "mtp_2": 19}
    assert all(int(terms[k][1]) == int(counts[k]) for k in counts)
    lm_mean = terms["lm"][0] / terms["lm"][1]
    mtp_mean = terms["mtp_1"][0] / terms["mtp_1"][1]
    # untrained: every term is about ln(64); mtp's carries the weight 0.4 / 2
    assert 0.15 < mtp_mean / lm_mean < 0.25


def test_unsupported_layouts_and_export_are_refused(tmp_path):
    with pytest.raises(LayoutError, match="got cp=2"):
        CONFIG.check_layout(LayoutSpec(cp=2))
    tied = CONFIG.model_copy(update={"tie_embeddings": True})
    with pytest.raises(LayoutError, match="tie_embeddings at pp=2"):
        tied.check_layout(LayoutSpec(pp=2))
    with pytest.raises(HFInteropError, match="multi-token prediction modules are not exported"):
        export_hf(CONFIG, _model().state_dict(), tmp_path)
    assert sum(p.numel() for p in _model().parameters()) == CONFIG.num_params()
