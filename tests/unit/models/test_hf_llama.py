"""HuggingFace Llama interop in one process, checked against transformers itself.

Import: a random tiny ``LlamaForCausalLM`` (GQA, tied and untied, shards) gives the same
logits in mtcore. Export: a random mtcore GPT loads in transformers with no missing or
unexpected keys and the same logits; a tokenizer travels with it. Bad input: what cannot
map is refused with an error that names it. transformers is imported once per module.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtcore.backend import select_backend
from mtcore.models.common.decoder.weights import load_full_weights
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import (
    HFInteropError,
    export_llama,
    import_llama,
    model_config_from_llama,
)

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=1e-5)
VOCAB, SEQ = 256, 24
HF_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
)
MT_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_llama(tied: bool, seed: int = 0):
    """A random LlamaForCausalLM; norm weights are randomised too (they start at one)."""
    config = transformers.LlamaConfig(
        **HF_SIZES, tie_word_embeddings=tied, initializer_range=0.1, attn_implementation="eager"
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def mt_gpt(config: GPTConfig, weights=None, seed: int = 0) -> GPT:
    model = GPT(config, single_context(config, select_backend("cpu"), seed)).eval()
    if weights is not None:
        model.load_state_dict(weights)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory):
    """{tied: (directory, logits on tokens())} of two saved random Llamas."""
    out = {}
    for tied in (False, True):
        model = hf_llama(tied, seed=int(tied))
        directory = tmp_path_factory.mktemp(f"hf_tied{int(tied)}")
        model.save_pretrained(directory)
        out[tied] = (directory, hf_logits(model, tokens()))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_import_gives_transformers_logits(saved_hf, tied):
    directory, expected = saved_hf[tied]
    config, weights = import_llama(directory, seq_len=SEQ)
    assert (config.num_kv_heads, config.ffn_size, config.tie_embeddings) == (2, 96, tied)
    assert (config.rope_theta, config.norm_eps, config.vocab_size) == (50000.0, 1e-5, VOCAB)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert ("output.weight" in weights) is not tied
    with torch.no_grad():
        logits = mt_gpt(config, weights)(tokens())
    torch.testing.assert_close(logits, expected, **TOL)
    # load_full_weights serves the one-process "layout" too.
    model = mt_gpt(config, seed=5)
    load_full_weights([model], weights)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), expected, **TOL)


def test_import_reads_sharded_safetensors(saved_hf, tmp_path):
    directory, expected = saved_hf[False]
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    config, weights = import_llama(tmp_path)
    assert config.seq_len == HF_SIZES["max_position_embeddings"]
    with torch.no_grad():
        torch.testing.assert_close(mt_gpt(config, weights)(tokens()), expected, **TOL)


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    config = GPTConfig(style="llama", tie_embeddings=tied, init_std=0.1, rope_theta=5e5, **MT_SIZES)
    model = mt_gpt(config, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        expected = model(tokens())
    weights = model.state_dict()
    export_llama(config, weights, tmp_path)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    assert hf.config.tie_word_embeddings is tied
    torch.testing.assert_close(hf_logits(hf.eval(), tokens()), expected, **TOL)
    # And back: lossless in fp32.
    config_back, weights_back = import_llama(tmp_path)
    unset = {"vocab_multiple", "ffn_hidden_size"}  # import states the ffn size explicitly
    assert config_back.model_dump(exclude=unset) == config.model_dump(exclude=unset)
    assert config_back.ffn_size == config.ffn_size
    assert weights_back.keys() == weights.keys()
    assert all(torch.equal(weights_back[k], weights[k]) for k in weights)


def test_bf16_export_with_a_tokenizer(tmp_path):
    from mtcore.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["hello world, the quick brown fox"] * 20, vocab_size=270)
    tok.save(str(tmp_path / "tok.json"))
    config = GPTConfig(style="llama", **{**MT_SIZES, "vocab_size": 384})
    weights = mt_gpt(config).state_dict()
    out = export_llama(config, weights, tmp_path / "hf", torch.bfloat16, tmp_path / "tok.json")
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["torch_dtype"] == "bfloat16"
    assert hf_config["vocab_size"] == 384  # the padded rows are exported
    assert hf_config["eos_token_id"] == tok.token_to_id("<|endoftext|>") == 0
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, f"files of one export differ in mode: {modes}"
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert fast.eos_token == "<|endoftext|>"
    assert fast.encode("the quick fox") == tok.encode("the quick fox").ids
    _, back = import_llama(out)
    assert torch.equal(
        back["layers.1.mlp.fc1.weight"], weights["layers.1.mlp.fc1.weight"].bfloat16().float()
    )


# -- refusals --------------------------------------------------------------------------
def test_export_refuses_what_llama_cannot_hold(tmp_path):
    gpt2 = GPTConfig(style="gpt2", **MT_SIZES)
    with pytest.raises(HFInteropError, match=r"style='gpt2'.*norm='layernorm'.*position='learned'"):
        export_llama(gpt2, mt_gpt(gpt2).state_dict(), tmp_path)
    biased = GPTConfig(style="llama", bias=True, **MT_SIZES)
    with pytest.raises(HFInteropError, match="bias=True"):
        export_llama(biased, {}, tmp_path)
    llama = GPTConfig(style="llama", **MT_SIZES)
    weights = mt_gpt(llama).state_dict()
    weights["layers.0.mlp.fc2.weight"] = weights["layers.0.mlp.fc2.weight"][:, :-1]
    del weights["norm.weight"]
    with pytest.raises(ValueError, match=r"missing norm\.weight.*layers\.0\.mlp\.fc2\.weight is"):
        export_llama(llama, weights, tmp_path)
    with pytest.raises(HFInteropError, match="dtype"):
        export_llama(llama, mt_gpt(llama).state_dict(), tmp_path, dtype=torch.int8)
    assert not (tmp_path / "model.safetensors").exists()


BASE = {**HF_SIZES, "model_type": "llama", "hidden_act": "silu"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_type='linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_type='dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"intermediate_size": None}, "lacks 'intermediate_size'"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
    ],
)
def test_import_refuses_configs_that_do_not_map(change, message):
    with pytest.raises(HFInteropError, match=message):
        model_config_from_llama({**BASE, **change})


def test_import_reads_old_and_new_rope_keys():
    assert model_config_from_llama({**BASE, "rope_theta": 7.0}).rope_theta == 7.0
    new = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 9.0}}
    del new["rope_theta"]
    assert model_config_from_llama(new).rope_theta == 9.0
    assert model_config_from_llama({**BASE, "rope_scaling": None}).rope_theta == 50000.0


def test_import_refuses_bad_files(saved_hf, tmp_path):
    directory, _ = saved_hf[False]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    tensors = load_file(directory / "model.safetensors")

    def write(changed):
        save_file(changed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    write({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(HFInteropError, match=r"lack 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        import_llama(tmp_path)
    write({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(HFInteropError, match=r"no place.*q_proj\.bias"):
        import_llama(tmp_path)
    write({**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1].clone()})
    with pytest.raises(
        HFInteropError, match=r"output\.weight is \[255, 64\], expected \[256, 64\]"
    ):
        import_llama(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HFInteropError, match=r"cannot read .*model\.safetensors"):
        import_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFInteropError, match=r"pytorch_model\.bin files are not read"):
        import_llama(tmp_path)
    with pytest.raises(HFInteropError, match="no HuggingFace model"):
        import_llama(tmp_path / "nowhere")


def test_import_refuses_an_untied_head_declared_tied(saved_hf, tmp_path):
    directory, _ = saved_hf[False]
    hf_config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "tie_word_embeddings": True}))
    shutil.copy(directory / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(HFInteropError, match=r"lm_head\.weight differs"):
        import_llama(tmp_path)


def test_import_accepts_a_tied_head_saved_twice(saved_hf, tmp_path):
    """Older transformers wrote lm_head.weight even when tied: equal to the embedding."""
    directory, expected = saved_hf[True]
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    tensors = load_file(directory / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config, weights = import_llama(tmp_path, seq_len=SEQ)
    assert config.tie_embeddings and "output.weight" not in weights
    with torch.no_grad():
        torch.testing.assert_close(mt_gpt(config, weights)(tokens()), expected, **TOL)
