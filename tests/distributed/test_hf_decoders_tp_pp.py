"""Llama 3.1, a custom head_dim, Qwen2 and Mistral imported under tp=2 x pp=2, and
Mixtral under ep=2 x tp=2, give transformers' logits (one spawn of 4 gloo ranks).

The test process saves random tiny transformers models and computes their logits.
Each rank imports every directory itself (``import_hf``: safetensors only), builds
its chunks, loads its shards with ``load_full_weights`` (experts: its ep block, then
its tp shard) and runs the tokens through the pipeline stages (``hf_pipeline``). The
export round trip of the same models is checked in one process by
``tests/unit/models/test_hf_decoders.py``. transformers is imported by the test only,
not at module level, which the ranks import.
"""

from __future__ import annotations

import pytest
import torch
from hf_pipeline import forward_logits

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.gpt import build_gpt
from mtcore.models.gpt.hf import import_hf
from mtcore.models.gpt.weights import load_full_weights
from mtcore.testing.distributed import run_ranks

VOCAB, SEQ = 256, 16
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    initializer_range=0.1,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=5e5,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
TP_PP = dict(tp=2, pp=2)
CASES = {  # name: (transformers config class, its settings, layout)
    "llama3.1": ("LlamaConfig", dict(rope_parameters=LLAMA3), TP_PP),
    "head_dim": ("LlamaConfig", dict(head_dim=24), dict(TP_PP, sequence_parallel=True)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True), TP_PP),
    "mistral": ("MistralConfig", dict(sliding_window=SEQ), TP_PP),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2),
        dict(ep=2, tp=2),
    ),
}


def _hf_model(transformers, class_name: str, seed: int, changes: dict):
    config = getattr(transformers, class_name)(**{**SIZES, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _rank_main(ctx, directories, tokens):
    torch.set_num_threads(1)
    out = {}
    for name, (_, _, layout_kw) in CASES.items():
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        config, weights = import_hf(directories[name])
        chunks = build_gpt(config, layout, ctx.backend, seed=123)  # seed: not the imported numbers
        load_full_weights(chunks, weights)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out[name] = forward_logits(chunks, layout, ctx.backend.collective, tokens)
    return out


def test_imported_decoders_give_transformers_logits_under_tp_pp_and_ep_tp(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    directories, expected = {}, {}
    for seed, (name, (class_name, changes, _)) in enumerate(CASES.items()):
        model = _hf_model(transformers, class_name, seed, changes)
        directories[name] = tmp_path / name
        model.save_pretrained(directories[name])
        with torch.no_grad():
            expected[name] = model(tokens).logits
    results = run_ranks(_rank_main, 4, directories, tokens)
    for name, (_, _, layout_kw) in CASES.items():
        # tp x pp: the last stage's tp pair returns logits; ep x tp (pp=1): every rank.
        got = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(got) == (2 if layout_kw.get("pp") else 4), name
        for logits in got:
            torch.testing.assert_close(logits, expected[name], atol=1e-5, rtol=1e-5)
