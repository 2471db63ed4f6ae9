"""Checkpoints of decoders whose layers are not all alike (issue 47, section 1).

``write_model_weights`` and ``read_model_weights`` (``mtcore convert``, ``load_model``,
``mtcore generate``) build a small template model whose first layers stand for every
layer. They once built ``moe_layer_freq`` layers and mapped layer i to i % freq, so a
model with dense first layers (every DeepSeek-V2/V3/R1 checkpoint, Qwen3-MoE's
``mlp_only_layers``) could be neither written nor read. Each pattern a config can
express goes through a write and a read here, bit for bit; then the same through
``mtcore convert from-hf`` and ``to-hf`` of transformers' own DeepSeek-V3 and
Qwen3-MoE models with 1 and 3 dense first layers (logits equal).
"""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.cli.main import main
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import import_hf
from mtcore.training.checkpoint import (
    CheckpointError,
    load_model,
    read_model_weights,
    write_model_weights,
)

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
MOE = dict(num_experts=4, top_k=2, ffn_size=16, shared_ffn_size=16, score="sigmoid")
SIZES = dict(vocab_size=64, hidden_size=32, num_heads=4, seq_len=16, ffn_hidden_size=48)
PATTERNS = {  # name: (num_layers, first_dense_layers, moe_layer_freq, mtp depth)
    "all_moe": (3, 0, 1, 0),
    "deepseek_v3_dense_3": (5, 3, 1, 0),
    "dense_1_mtp": (4, 1, 1, 2),
    "freq_2": (5, 0, 2, 0),
    "dense_1_freq_2_mtp": (6, 1, 2, 3),  # MoE in 2, 4; MTP blocks as layers 6, 7, 8
    "dense_2_freq_3": (9, 2, 3, 1),
}


def _config(layers: int, dense: int, freq: int, depth: int) -> GPTConfig:
    mtp = dict(depth=depth) if depth else None
    return GPTConfig(**SIZES, num_layers=layers, mla=MLA, moe=MOE, first_dense_layers=dense,
                     moe_layer_freq=freq, mtp=mtp)  # fmt: skip


def _weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(config, single_context(config, select_backend("cpu")))
    weights = model.state_dict()
    for name, buffer in weights.items():  # the router biases are trained state too
        if name.endswith("expert_bias"):
            buffer.copy_(torch.randn_like(buffer))
    return weights


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_every_layer_pattern_writes_and_reads_back(pattern, tmp_path):
    config = _config(*PATTERNS[pattern])
    assert config.template_layers < config.num_layers or pattern == "all_moe"
    for index in range(config.num_layers):  # each layer's stand-in is of its kind
        stand_in = config.template_layer(index)
        assert stand_in < config.template_layers
        assert config.is_moe_layer(stand_in) == config.is_moe_layer(index), index
    weights = _weights(config)
    write_model_weights(tmp_path, weights, config, step=3)
    config_back, weights_back, step = read_model_weights(tmp_path)
    assert (config_back, step) == (config, 3)
    assert weights_back.keys() == weights.keys()
    assert all(torch.equal(weights_back[k], weights[k]) for k in weights)
    model, _, _ = load_model(tmp_path)  # generate's and to-hf's path: strict load
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_a_layer_of_the_wrong_kind_or_past_the_stack_is_refused(tmp_path):
    config = _config(*PATTERNS["deepseek_v3_dense_3"])
    weights = _weights(config)
    wrong = dict(weights)  # layer 1 is dense: a router there is not this model's
    wrong["layers.1.mlp.router.weight"] = weights["layers.3.mlp.router.weight"]
    with pytest.raises(CheckpointError, match=r"'layers\.1\.mlp\.router\.weight' is not a param"):
        write_model_weights(tmp_path / "wrong", wrong, config)
    past = {**weights, "layers.5.mlp.router.weight": weights["layers.3.mlp.router.weight"]}
    with pytest.raises(CheckpointError, match=r"'layers\.5\.mlp\.router\.weight' is not a param"):
        write_model_weights(tmp_path / "past", past, config)
    fewer = config.model_copy(update={"num_layers": 4})  # layer 4's tensors left over
    write_model_weights(tmp_path / "fewer", weights, config)
    manifest = next((tmp_path / "fewer").glob("step_*/manifest.json"))
    header = json.loads(manifest.read_text())
    header["model_config"] = fewer.model_dump(mode="json")
    manifest.write_text(json.dumps(header))
    with pytest.raises(CheckpointError, match=r"unexpected weights .*layers\.4\."):
        read_model_weights(tmp_path / "fewer")


def test_a_moe_config_with_no_moe_layer_is_refused():
    """Issue 48: ``first_dense_layers`` >= layers trained with 'MoE in 0 of 3 layers'."""
    for dense, freq in ((3, 1), (5, 1), (1, 4)):
        with pytest.raises(ValueError, match=r"none of the 3 layers is MoE"):
            GPTConfig(**SIZES, num_layers=3, moe=MOE, first_dense_layers=dense,
                      moe_layer_freq=freq if dense == 1 else 1)  # fmt: skip
    assert GPTConfig(**SIZES, num_layers=3, moe=MOE, first_dense_layers=2).num_moe_layers == 1
    assert GPTConfig(**SIZES, num_layers=3, first_dense_layers=5).num_moe_layers == 0  # dense


# -- through `mtcore convert`, against transformers ------------------------------------
VOCAB, SEQ = 96, 12
DEEPSEEK_V3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                   moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                   q_lora_rank=16, **MLA, max_position_embeddings=SEQ, initializer_range=0.1,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
QWEN3_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                 moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=SEQ, initializer_range=0.1,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip


def _hf_model(transformers, kind: str, dense: int):
    if kind == "deepseek_v3":
        config = transformers.DeepseekV3Config(**DEEPSEEK_V3, first_k_dense_replace=dense)
        model_class = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE, mlp_only_layers=list(range(dense)))
        model_class = transformers.Qwen3MoeForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(dense)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones: a norm left out or misplaced shows
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers[dense:] if kind == "deepseek_v3" else []:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(4))
    return model


def _logits(model) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("dense", [1, 3])
def test_convert_from_hf_and_back_with_dense_first_layers(kind, dense, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = _hf_model(transformers, kind, dense)
    hf.save_pretrained(tmp_path / "hf")
    expected = _logits(hf)
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    config, weights, _ = read_model_weights(tmp_path / "ckpt")
    assert config.first_dense_layers == dense and config.num_moe_layers == 4 - dense
    want_config, want = import_hf(tmp_path / "hf")
    assert config == want_config and weights.keys() == want.keys()
    assert all(torch.equal(weights[k], want[k]) for k in want)
    model, _, _ = load_model(tmp_path / "ckpt")
    torch.testing.assert_close(_logits(model), expected, atol=1e-5, rtol=1e-5)

    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                 "--dtype", "fp32"]) == 0  # fmt: skip
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert type(back) is type(hf) and not any(info.values()), info
    torch.testing.assert_close(_logits(back.eval()), expected, atol=1e-5, rtol=1e-5)
