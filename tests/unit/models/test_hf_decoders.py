"""Llama 3.1, a custom head_dim, Qwen2, Mistral, Mixtral, Qwen3 and Qwen3-MoE interop in
one process,
against transformers itself (random tiny models; fp32).

Each saved model imports with transformers' logits; the import exports back to a
directory transformers loads with no missing or unexpected keys and the same logits
(as several shards with an index, under a small shard limit), and imports again bit
for bit. What an architecture cannot hold is refused naming the part. The tokenizer
export follows mtcore's special-token rule (a literal ``<|endoftext|>`` is text).
"""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.common.decoder.rope import gpt_rope_tables, llama3_inv_freq
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import HFInteropError, export_hf, import_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = dict(atol=1e-5, rtol=1e-5)
VOCAB, SEQ = 128, 20
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    initializer_range=0.1,
)
# Bands of llama3 scaling for head size 16 at theta 5e5: wavelengths 6.3 (kept), 32.5
# (interpolated: between 64 / 4 and 64 / 1) and 168 and up (stretched by 8).
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
CASES = {
    "llama3.1": ("LlamaConfig", dict(rope_parameters={**LLAMA3, "rope_theta": 5e5})),
    "head_dim": ("LlamaConfig", dict(head_dim=24)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=SEQ, head_dim=8)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # Windows shorter than the sequence: each query sees its last 7 (5) keys.
    "mistral_window7": ("MistralConfig", dict(sliding_window=7)),
    "qwen2_window5": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
    ),
}


def hf_model(class_name: str, seed: int = 0, **changes):
    """A random transformers model; norm weights and biases are randomised too."""
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


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens())
    return out if isinstance(out, torch.Tensor) else out.logits


def mt_gpt(config: GPTConfig, weights) -> GPT:
    model = GPT(config, single_context(config, select_backend("cpu"))).eval()
    model.load_state_dict(weights)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (directory, transformers' logits)}."""
    out = {}
    for i, (name, (class_name, changes)) in enumerate(CASES.items()):
        model = hf_model(class_name, seed=i, **changes)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        out[name] = (directory, logits_of(model))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_and_exports_back(saved, case, tmp_path):
    directory, expected = saved[case]
    config, weights = import_hf(directory)
    torch.testing.assert_close(logits_of(mt_gpt(config, weights)), expected, **TOL)

    out = export_hf(config, weights, tmp_path / "hf", max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    written = json.loads((out / "config.json").read_text())
    assert (
        written["model_type"] == json.loads((directory / "config.json").read_text())["model_type"]
    )
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not {k: v for k, v in info.items() if v}
    torch.testing.assert_close(logits_of(back.eval()), expected, **TOL)
    config_back, weights_back = import_hf(out)
    assert config_back == config
    assert weights_back.keys() == weights.keys()
    assert all(torch.equal(weights_back[k], weights[k]) for k in weights)


def test_what_each_import_becomes(saved):
    llama31, _ = import_hf(saved["llama3.1"][0])
    assert llama31.rope_theta == 5e5 and llama31.rope_scaling.factor == 8.0
    head_dim, _ = import_hf(saved["head_dim"][0])
    assert (head_dim.head_size, head_dim.head_dim, head_dim.hidden_size) == (24, 24, 64)
    qwen2, weights = import_hf(saved["qwen2_tied"][0])
    assert qwen2.qkv_bias and qwen2.tie_embeddings and "layers.0.attn.qkv.bias" in weights
    assert "layers.0.attn.proj.bias" not in weights
    mistral, _ = import_hf(saved["mistral"][0])
    assert (mistral.sliding_window, mistral.head_size) == (SEQ, 8)  # narrower than 64 / 4
    mixtral, weights = import_hf(saved["mixtral"][0])
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.ffn_size) == (4, 2, 96)
    assert weights["layers.1.mlp.experts.fc1"].shape == (4, 64, 192)
    qwen3, weights = import_hf(saved["qwen3"][0])
    assert (
        qwen3.qk_norm
        and not qwen3.qkv_bias
        and weights["layers.0.attn.q_norm.weight"].shape == (24,)
    )
    qwen3_moe, weights = import_hf(saved["qwen3_moe"][0])
    assert qwen3_moe.first_dense_layers == 1 and qwen3_moe.moe.shared_ffn_size == 0
    assert qwen3_moe.moe.norm_topk and "layers.0.mlp.fc1.weight" in weights


def test_the_hub_rope_form_reads_as_transformers_5_form():
    new = {**SIZES, "model_type": "llama", "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}
    old = {**SIZES, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": LLAMA3}
    assert model_config_from_hf(old) == model_config_from_hf(new)
    assert model_config_from_hf(old).rope_scaling.original_max_position_embeddings == 64


def test_llama3_tables_are_transformers_frequencies():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        **SIZES, head_dim=16, rope_parameters={**LLAMA3, "rope_theta": 5e5}
    )
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf)
    config = model_config_from_hf({**hf.to_dict(), "model_type": "llama"})
    d = config.head_dim
    plain = 1.0 / (5e5 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    got = llama3_inv_freq(plain, config.rope_scaling)
    assert scale == 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, plain) and torch.equal(got[0], plain[0])  # bands differ
    cos, _ = gpt_rope_tables(config)
    torch.testing.assert_close(cos[5], torch.cos(5 * got).float())


# -- refusals --------------------------------------------------------------------------
MT = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, seq_len=SEQ)
MOE = dict(num_experts=4, top_k=2, ffn_size=32)


def _random_weights(config: GPTConfig) -> dict:
    return GPT(config, single_context(config, select_backend("cpu"))).state_dict()


@pytest.mark.parametrize(
    "model, message",
    [
        (dict(moe={**MOE, "shared_ffn_size": 32}), r"Mixtral cannot hold a shared expert"),
        (dict(moe={**MOE, "bias_update_rate": 1e-3}), r"an expert bias \(moe\.bias_update"),
        (dict(moe={**MOE, "capacity_factor": 1.0}), r"token dropping"),
        (dict(moe={**MOE, "score": "sigmoid"}), r"moe\.score='sigmoid'"),
        (dict(moe=MOE, moe_layer_freq=2), r"dense layers between MoE layers"),
        (dict(moe=MOE, first_dense_layers=1), r"dense first layers \(first_dense_layers=1\)"),
        (dict(moe={**MOE, "expert_groups": 2}), r"group-limited routing"),
        (dict(moe={**MOE, "shared_ffn_size": 32}, qk_norm=True), r"Qwen3-MoE cannot hold a shared"),
    ],
)
def test_export_refuses_what_mixtral_and_qwen3_moe_cannot_hold(tmp_path, model, message):
    config = GPTConfig(**MT, **model)
    with pytest.raises(HFInteropError, match=message):
        export_hf(config, _random_weights(config), tmp_path)
    assert not list(tmp_path.iterdir())


def test_export_refuses_a_trained_expert_bias_and_wrong_architectures(tmp_path):
    moe = GPTConfig(**MT, moe=MOE)
    weights = _random_weights(moe)
    weights["layers.1.mlp.router.expert_bias"][2] = 0.5
    with pytest.raises(HFInteropError, match=r"layers\.1\.mlp\.router\.expert_bias is nonzero"):
        export_hf(moe, weights, tmp_path)
    with pytest.raises(HFInteropError, match="cannot be exported as Llama; export it as mixtral"):
        export_hf(moe, weights, tmp_path, architecture="llama")
    dense = GPTConfig(**MT, qkv_bias=True)
    with pytest.raises(HFInteropError, match=r"qkv_bias=True: Mistral .*qwen2"):
        export_hf(dense, _random_weights(dense), tmp_path, architecture="mistral")
    with pytest.raises(HFInteropError, match=r"a dense model .* as Mixtral"):
        export_hf(dense, _random_weights(dense), tmp_path, architecture="mixtral")
    windowed = GPTConfig(**MT, sliding_window=SEQ)
    with pytest.raises(HFInteropError, match=r"sliding_window=20: Llama .*mistral"):
        export_hf(windowed, _random_weights(windowed), tmp_path, architecture="llama")


BASE = {**SIZES, "hidden_act": "silu"}


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
            },
            r"sliding_window=8 in layers \[1\] only: .*one window.*--seq-len 8",
        ),
        ({"model_type": "gemma"}, r"model_type='gemma'.*'llama', 'mistral', 'qwen2', 'mixtral'"),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}},
            "rope_type='longrope'",
        ),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}, "'yarn' lacks factor"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}}, "lacks factor"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias=true"),
        ({"model_type": "mixtral", "num_local_experts": 4}, "lacks 'num_experts_per_tok'"),
    ],
)
def test_import_refuses_what_does_not_map(config, message):
    with pytest.raises(HFInteropError, match=message):
        model_config_from_hf({**BASE, **config})


def test_a_window_as_long_as_the_sequence_imports_and_a_shorter_one_too():
    mistral = {**BASE, "model_type": "mistral", "sliding_window": 8}
    assert model_config_from_hf(mistral, seq_len=8).sliding_window == 8
    assert model_config_from_hf(mistral).sliding_window == 8  # seq_len 20
    mixed = {**BASE, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}
    assert model_config_from_hf({**mixed, "sliding_window": 20}).sliding_window == 20
    qwen2 = {**BASE, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8}
    assert model_config_from_hf(qwen2).sliding_window is None  # off: no window at all


# -- the tokenizer ---------------------------------------------------------------------
def test_exported_tokenizer_tokenizes_like_mtcore_and_names_its_tokens(tmp_path):
    from mtcore.data.tokenizer import Tokenizer, train_tokenizer

    trained = train_tokenizer(["hello world, the quick brown fox"] * 20, vocab_size=270)
    trained.save(str(tmp_path / "tok.json"))
    mine = Tokenizer(trained)
    config = GPTConfig(**{**MT, "vocab_size": 384})
    out = export_hf(
        config, _random_weights(config), tmp_path / "hf", tokenizer_json=tmp_path / "tok.json"
    )
    fast = transformers.AutoTokenizer.from_pretrained(out)
    text = "the quick fox<|endoftext|>hello <|endoftext|> world"
    assert fast.encode(text, add_special_tokens=False) == mine.encode(text)
    assert mine.eod_id not in mine.encode(text)  # the literal is text, in both
    eod = mine.eod_id
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"]) == (
        eod,
        eod,
        eod,
    )
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == ("<|endoftext|>",) * 3
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (eod, eod, eod)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == eod


def test_a_llama3_tokenizer_keeps_begin_of_text_as_bos(tmp_path):
    """Llama 3's tokenizer.json (special tokens <|begin_of_text|> and <|end_of_text|>, a
    template that prepends the first): bos is <|begin_of_text|>, eos and pad the
    end-of-document <|end_of_text|>, in tokenizer_config.json and config.json alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    llama3 = Tokenizer(models.BPE())
    llama3.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    llama3.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=270,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    llama3.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    llama3.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    llama3.save(str(tmp_path / "tok.json"))
    config = GPTConfig(**{**MT, "vocab_size": 384})
    out = export_hf(
        config, _random_weights(config), tmp_path / "hf", tokenizer_json=tmp_path / "tok.json"
    )
    hf_config = json.loads((out / "config.json").read_text())
    ids = (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"])
    assert ids == (0, 1, 1)
    fast = transformers.AutoTokenizer.from_pretrained(out)
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == (*specials, specials[1])
    assert fast.encode("hello")[0] == fast.bos_token_id == 0  # what the template prepends
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (0, 1)


def test_a_small_export_is_one_file(tmp_path):
    config = GPTConfig(**MT)
    out = export_hf(config, _random_weights(config), tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_convert_to_hf_shards_at_max_shard_size(tmp_path, capsys):
    from mtcore.cli.main import main
    from mtcore.training.checkpoint import write_model_weights

    config = GPTConfig(**MT)
    weights = _random_weights(config)
    write_model_weights(tmp_path / "ckpt", weights, config)
    argv = ["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "fp32"]
    assert main([*argv, "--max-shard-size", "0.04MB"]) == 0
    shards = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and all(p.stat().st_size < 60_000 for p in shards)
    _, back = import_hf(tmp_path / "hf")
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    assert main([*argv, "--force", "--max-shard-size", "five gigs"]) == 2
    assert "--max-shard-size 'five gigs' is not a number of bytes" in capsys.readouterr().err


@pytest.mark.parametrize("moe", [MOE, {**MOE, "top_k": 1, "topk_then_softmax": True}])
def test_an_mtcore_moe_gpt_exports_as_mixtral_with_its_logits(tmp_path, moe):
    """Switch-order routing (softmax, top-k, renormalise: the MoESpec default) and the
    softmax over the chosen logits are both Mixtral's."""
    config = GPTConfig(**MT, moe=moe, init_std=0.1)
    weights = _random_weights(config)
    expected = logits_of(mt_gpt(config, weights))
    out = export_hf(config, weights, tmp_path)
    hf = transformers.MixtralForCausalLM.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(logits_of(hf.eval()), expected, **TOL)


def test_new_switches_default_to_the_plain_model():
    """No head_size, qkv_bias, rope_scaling or window: today's model, bit for bit."""
    from mtcore.ops import rope_tables

    plain = GPTConfig(**MT)
    assert plain.head_dim == 16 and not plain.qkv_bias
    assert all(
        torch.equal(a, b) for a, b in zip(gpt_rope_tables(plain), rope_tables(SEQ, 16), strict=True)
    )
    sized = GPTConfig(**MT, head_size=24, qkv_bias=True)
    model = GPT(sized, single_context(sized, select_backend("cpu")))
    assert sized.num_params() == sum(p.numel() for p in model.parameters())
    assert model.layers["0"].attn.proj.bias is None
    assert model.layers["0"].attn.qkv.bias.shape == ((4 + 2 * 4) * 24,)
    window8 = GPTConfig(**MT, sliding_window=8)
    windowed = GPT(window8, single_context(window8, select_backend("cpu")))
    assert windowed.layers["0"].attn.window == 8 and model.layers["0"].attn.window is None
    with pytest.raises(ValueError, match=r"hidden_size=62 is not divisible .*\(set head_size"):
        GPTConfig(**{**MT, "hidden_size": 62})
    assert GPTConfig(**{**MT, "hidden_size": 62}, head_size=16).head_dim == 16
