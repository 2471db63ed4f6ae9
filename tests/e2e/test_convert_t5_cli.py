"""HF T5 -> `mtcore convert from-hf` -> `convert to-hf` -> transformers, as a user runs it.

A random tiny ``T5ForConditionalGeneration`` (v1.1: gated-GELU; transformers 5 stores
its head as the embedding) with a byte-level BPE ``tokenizer.json`` holding T5's
special tokens is imported into an mtcore checkpoint (the family picked by
``model_type``, the tokenizer carried) and exported back; transformers loads the
export with the original's logits and its tokenizer with ``<pad>``, ``</s>`` and the
sentinels. An original-T5 ReLU feed-forward is refused naming the field.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mtcore.data.tokenizer import train_tokenizer
from mtcore.models.t5.data import T5_SPECIAL_TOKENS
from mtcore.models.t5.hf import import_t5
from mtcore.training.checkpoint import read_model_weights, resolve_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 384, 16


def _hf_t5(directory, feed_forward_proj="gated-gelu"):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, feed_forward_proj=feed_forward_proj, decoder_start_token_id=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration(config).eval()
        model.save_pretrained(directory)
    text = ["def alpha(self, x):\n    return self.beta + x\n"] * 30
    train_tokenizer(text, 300, T5_SPECIAL_TOKENS).save(str(directory / "tokenizer.json"))
    return model


# slow: T5's import is in the default suite as tests/distributed/test_hf_t5_tp_pp.py,
# and `mtcore convert`'s round trip as test_convert_cli.py (GPT).
@pytest.mark.slow
def test_t5_convert_from_hf_and_back(tmp_path, run_mtcore):
    hf_dir, root, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    model = _hf_t5(hf_dir)
    g = torch.Generator().manual_seed(1)
    tokens, decoder = (
        torch.randint(0, VOCAB, (2, SEQ), generator=g),
        torch.randint(0, VOCAB, (2, 6), generator=g),
    )
    with torch.no_grad():
        expected = model(input_ids=tokens, decoder_input_ids=decoder).logits

    imported = run_mtcore("convert", "from-hf", hf_dir, root, "--seq-len", SEQ)
    assert imported.returncode == 0, imported.stderr
    directory = resolve_checkpoint(root)
    assert imported.stdout.strip() == str(directory)
    assert "  family: t5\n" in imported.stderr and "tokenizer not carried" not in imported.stderr
    config, weights, step = read_model_weights(root)
    want_config, want_weights = import_t5(hf_dir, seq_len=SEQ)
    assert (config, step) == (want_config, 0) and weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)

    back = run_mtcore("convert", "to-hf", root, out, "--dtype", "fp32")
    assert back.returncode == 0, back.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "t5" and saved["feed_forward_proj"] == "gated-gelu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        got = reloaded(input_ids=tokens, decoder_input_ids=decoder).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    fast = transformers.AutoTokenizer.from_pretrained(out)
    assert (fast.pad_token, fast.eos_token) == ("<pad>", "</s>")
    assert "<extra_id_99>" in fast.all_special_tokens
    sentinel = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in sentinel}
    assert ids["<extra_id_0>"] in fast.encode("def <extra_id_0>(self):")  # read as the sentinel


@pytest.mark.slow  # the refusal itself is tested in-process (tests/unit/models/test_t5_hf.py)
def test_an_original_t5_relu_feed_forward_is_refused(tmp_path, run_mtcore):
    _hf_t5(tmp_path / "hf", feed_forward_proj="relu")
    refused = run_mtcore("convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert refused.returncode != 0
    assert "feed_forward_proj='relu'" in refused.stderr, refused.stderr
    assert not (tmp_path / "ckpt").exists()
