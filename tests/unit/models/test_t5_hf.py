"""T5 and HuggingFace: a saved transformers T5 imports, an mtcore T5 exports (with its
tokenizer) and loads in transformers with the same logits, variants the family does
not implement are refused naming the field; generation with the KV cache writes the
no-cache path's tokens and transformers' greedy tokens."""

from __future__ import annotations

import json
import warnings

import pytest
import tokenizers
import torch

from mtcore.data import Tokenizer
from mtcore.data.tokenizer import train_tokenizer
from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.t5 import T5, T5Config
from mtcore.models.t5.data import T5_SPECIAL_TOKENS
from mtcore.models.t5.generate import encode_prompt, generate_ids, generate_text
from mtcore.models.t5.hf import export_t5, import_t5
from mtcore.models.t5.weights import load_full_weights

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, DEC = 96, 16, 8
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, head_dim=8, ffn_hidden_size=48, encoder_layers=2,
    decoder_layers=3, num_heads=4, relative_buckets=8, relative_max_distance=12, dropout=0.0,
    seq_len=SEQ, decoder_seq_len=DEC,
)  # fmt: skip


def _inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens, decoder = (
        torch.randint(2, VOCAB, (2, SEQ), generator=g),
        torch.randint(2, VOCAB, (2, DEC), generator=g),
    )
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[1, 9:] = False
    return tokens, decoder, mask


def _hf_logits(model, tokens, decoder, mask):
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=mask.long(), decoder_input_ids=decoder).logits


def _saved_hf(tmp_path, **overrides):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=12, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration(config).eval()
        model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_saved_transformers_t5_imports_with_its_logits(tmp_path, tie, one_thread):
    hf = _saved_hf(tmp_path, tie_word_embeddings=tie)
    config, weights = import_t5(tmp_path, seq_len=SEQ)
    assert (config.encoder_layers, config.decoder_layers, config.kv_dim) == (2, 3, 8)
    model = T5(config.model_copy(update={"decoder_seq_len": DEC})).eval()
    load_full_weights([model], weights)
    tokens, decoder, mask = _inputs()
    want = _hf_logits(hf, tokens, decoder, mask)
    with torch.no_grad():
        got = model(tokens, decoder, mask)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _t5_tokenizer() -> Tokenizer:
    text = ["def forward(self, x):\n    return self.layer(x) + x\n"] * 20
    return Tokenizer(
        train_tokenizer(text, 300, T5_SPECIAL_TOKENS), required_tokens=T5_SPECIAL_TOKENS
    )


@pytest.mark.parametrize("tie", [False, True])
def test_exported_t5_loads_in_transformers_with_the_same_logits(tmp_path, tie, one_thread):
    tok = _t5_tokenizer()
    (tmp_path / "tok.json").write_text(tok.hf.to_str())
    config = T5Config(tie_embeddings=tie, **SIZES)
    model = T5(config).eval()
    out = export_t5(
        config, model.state_dict(), tmp_path / "hf", tokenizer_json=tmp_path / "tok.json"
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["pad_token_id"] == saved["decoder_start_token_id"] == tok.token_id("<pad>")
    assert saved["eos_token_id"] == tok.token_id("</s>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    tokens, decoder, mask = _inputs()
    want = model(tokens, decoder, mask).detach()
    got = _hf_logits(reloaded, tokens, decoder, mask)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    fast = transformers.AutoTokenizer.from_pretrained(out)
    assert (fast.pad_token, fast.eos_token) == ("<pad>", "</s>")
    assert fast.convert_tokens_to_ids("<extra_id_7>") == tok.token_id("<extra_id_7>")
    again, weights = import_t5(out, seq_len=SEQ)  # and back: the same numbers
    assert again.tie_embeddings is tie
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"feed_forward_proj": "relu"},
            r"feed_forward_proj='relu': mtcore's T5 implements v1.1's gated-GELU",
        ),
        ({"feed_forward_proj": "gated-silu"}, r"feed_forward_proj='gated-silu'"),
        ({"is_encoder_decoder": False}, r"is_encoder_decoder=false"),
        ({"model_type": "bert"}, r"model_type='bert': only HuggingFace T5"),
    ],
)
def test_variants_that_do_not_map_are_refused_by_name(tmp_path, change, needle, one_thread):
    _saved_hf(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFInteropError, match=needle):
        import_t5(tmp_path)


def test_a_tied_head_that_differs_is_refused(tmp_path, one_thread):
    from safetensors.torch import load_file, save_file

    _saved_hf(tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["shared.weight"] + 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFInteropError, match=r"lm_head.weight differs from shared.weight"):
        import_t5(tmp_path)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("top_k", [None, 5])
def test_the_kv_cache_writes_the_no_cache_tokens(tie, top_k, one_thread):
    model = T5(T5Config(tie_embeddings=tie, **SIZES)).eval()
    tokens, _, mask = _inputs(4)
    runs = [
        generate_ids(
            model, tokens, 12, 0, None, top_k, 0.8, torch.Generator().manual_seed(1), mask, cache
        )
        for cache in (True, False)
    ]
    assert runs[0].shape == (2, 13) and torch.equal(runs[0], runs[1])


def test_greedy_decoding_matches_transformers(tmp_path, one_thread):
    hf = _saved_hf(tmp_path)
    config, weights = import_t5(tmp_path, seq_len=SEQ)
    model = T5(config).eval()
    load_full_weights([model], weights)
    tokens, _, mask = _inputs(5)
    with torch.no_grad():
        want = hf.generate(
            input_ids=tokens, attention_mask=mask.long(), max_new_tokens=10, min_new_tokens=10,
            do_sample=False, use_cache=False,  # this transformers' T5 cache fails in generate
        )  # fmt: skip
    got = generate_ids(model, tokens, 10, 0, padding_mask=mask)
    assert torch.equal(got, want)


def test_family_generate_reads_sentinels_in_the_prompt(one_thread):
    tok = _t5_tokenizer()
    ids = encode_prompt(tok, "def <extra_id_0>(self, x):<extra_id_1>")
    assert ids[-1] == tok.token_id("</s>") and tok.token_id("<extra_id_0>") in ids
    assert ids.index(tok.token_id("<extra_id_1>")) == len(ids) - 2
    model = T5(T5Config(**{**SIZES, "vocab_size": 384})).eval()
    text = generate_text(
        model, tok, "def <extra_id_0>(self):", 6, generator=torch.Generator().manual_seed(0)
    )
    assert isinstance(text, str) and "<pad>" not in text
    assert isinstance(tokenizers.Tokenizer.from_str(tok.hf.to_str()), tokenizers.Tokenizer)
