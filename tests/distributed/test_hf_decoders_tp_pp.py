"""Llama 3.1, a custom head_dim, Qwen2 and Mistral (with a window as long as the text
and one shorter) imported under tp=2 x pp=2, Mixtral under ep=2 x tp=2, DeepSeek-V3
under tp=2 x pp=2 with sequence parallel, ep=2 and ep=2 x tp=2, Qwen3 under tp=2 x
pp=2 and Qwen3-MoE under ep=2 x tp=2 give transformers' logits; the imported Llama
generates transformers' greedy tokens under tp=2 (x dp=2), with and without the KV
cache (one spawn of 4 gloo ranks).

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

from mtcore.models.common.decoder.weights import load_full_weights
from mtcore.models.gpt import build_gpt
from mtcore.models.gpt.hf import import_hf
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

VOCAB, SEQ, PROMPT = 256, 16, 4
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
DEEPSEEK = dict(  # latent attention with YaRN, a dense first layer, grouped routing
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=1e4,
        factor=4.0,
        original_max_position_embeddings=4,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
CASES = {  # name: (transformers config class, its settings, layout)
    "llama3.1": ("LlamaConfig", dict(rope_parameters=LLAMA3), TP_PP),
    "head_dim": ("LlamaConfig", dict(head_dim=24), dict(TP_PP, sequence_parallel=True)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True), TP_PP),
    "mistral": ("MistralConfig", dict(sliding_window=SEQ), TP_PP),
    "mistral_window5": ("MistralConfig", dict(sliding_window=5), TP_PP),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2),
        dict(ep=2, tp=2),
    ),
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK, dict(TP_PP, sequence_parallel=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24), TP_PP),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        dict(ep=2, tp=2),
    ),
    "deepseek_v3_ep2": ("DeepseekV3Config", DEEPSEEK, dict(ep=2)),
    "deepseek_v3_ep2_tp2": ("DeepseekV3Config", DEEPSEEK, dict(ep=2, tp=2)),
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
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's aux-loss-free bias
                buffer.copy_(0.05 * torch.randn_like(buffer))
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
    out["generated"] = _generate_under_tp(ctx, directories["llama3.1"], tokens[:, :PROMPT])
    return out


def _generate_under_tp(ctx, directory, prompt) -> list:
    """Greedy tokens of the imported Llama at tp=2, cached and uncached."""
    layout = ParallelLayout.build(LayoutSpec(tp=2), ctx.backend.collective, ctx.rank, 4)
    config, weights = import_hf(directory)
    (model,) = build_gpt(config, layout, ctx.backend, seed=123)
    load_full_weights([model], weights)
    model.eval()
    return [model.generate(prompt, SEQ - PROMPT, use_cache=c) for c in (True, False)]


def test_imported_decoders_give_transformers_logits_under_tp_pp_and_ep_tp(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    directories, expected, models = {}, {}, {}
    for seed, (name, (class_name, changes, _)) in enumerate(CASES.items()):
        model = models[name] = _hf_model(transformers, class_name, seed, changes)
        directories[name] = tmp_path / name
        model.save_pretrained(directories[name])
        with torch.no_grad():
            expected[name] = model(tokens).logits
    with torch.no_grad():
        greedy = models["llama3.1"].generate(
            tokens[:, :PROMPT], attention_mask=torch.ones_like(tokens[:, :PROMPT]),
            max_new_tokens=SEQ - PROMPT, do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    results = run_ranks(_rank_main, 4, directories, tokens)
    for rank in range(4):
        cached, uncached = results[rank]["generated"]
        assert torch.equal(cached, greedy) and torch.equal(uncached, greedy), rank
    for name, (_, _, layout_kw) in CASES.items():
        # tp x pp: the last stage's tp pair returns logits; ep x tp (pp=1): every rank.
        got = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(got) == (2 if layout_kw.get("pp") else 4), name
        for logits in got:
            torch.testing.assert_close(logits, expected[name], atol=1e-5, rtol=1e-5)
