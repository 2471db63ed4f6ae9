"""HF BERT -> `mtcore convert from-hf` -> `mtcore train` at tp2 x pp2 -> `convert to-hf`.

As a user runs it (subprocesses, real files): a random tiny ``BertForPreTraining``
saved by transformers (safetensors) with a WordPiece ``tokenizer.json`` (trained here
with the ``tokenizers`` library on the corpus; [CLS] [SEP] [MASK] [PAD] [UNK], a BERT
post-processor) is imported; the printed training settings (``family: bert``, the
checkpoint, the carried tokenizer) plus a layout and data paths make the job that
`mtcore train --nproc 4` runs for 3 steps under tp=2 x pp=2; the trained checkpoint
is exported and loads in transformers with the logits of mtcore's one-process model
of that checkpoint, and its tokenizer encodes sentence pairs as the original does.
The model's 128 embedding rows exceed the tokenizer's ids, as a padded vocab does.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mtcore.models.bert.hf import import_bert
from mtcore.training.checkpoint import load_model, read_model_weights, resolve_checkpoint

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

MTCORE = Path(sys.executable).with_name("mtcore")
VOCAB, SEQ, STEPS = 128, 32, 3
STEP_LINE = re.compile(r"^step (\d+)/3 \| loss ([0-9.]+) \(mlm [0-9.]+, pair [0-9.]+\)", re.M)
WORDS = [
    "the", "model", "reads", "a", "line", "of", "text", "and", "learns", "which", "word",
    "was", "hidden", "from", "it", "while", "another", "head", "guesses", "whether",
    "second", "sentence", "follows", "first",
]  # fmt: skip
PAIRS = [("The model reads a line.", "Which word was hidden?"), ("text and words", "it")]


def _run(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [str(MTCORE), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _corpus(root: Path) -> Path:
    root.mkdir()
    rng = random.Random(0)
    for i in range(8):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(6, 12))) + "." for _ in range(12)]
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    return root


def _wordpiece(corpus: Path) -> tokenizers.Tokenizer:
    """A BERT-style WordPiece tokenizer with fewer ids than the model has rows."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=100, special_tokens=special, show_progress=False)
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    assert tok.get_vocab_size() < VOCAB
    return tok


# slow: BERT's import under tp2 x pp2 is in the default suite as
# tests/distributed/test_hf_bert_tp_pp.py; this is the CLI round trip with training.
@pytest.mark.slow
def test_bert_from_hf_trains_under_tp2_pp2_and_exports_back(tmp_path, tiny_bert):
    corpus = _corpus(tmp_path / "docs")
    hf_dir, root, run, out = (tmp_path / name for name in ("hf", "imported", "run", "out"))
    tokenizer = _wordpiece(corpus)
    model = tiny_bert.model(vocab_size=VOCAB, max_position_embeddings=SEQ, num_hidden_layers=4)
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    assert (hf_dir / "model.safetensors").is_file()

    # import: a weights-only step-0 checkpoint with the tokenizer, and the settings to use
    imported = _run("convert", "from-hf", hf_dir, root)
    assert imported.returncode == 0, imported.stderr
    directory = resolve_checkpoint(root)
    assert imported.stdout.strip() == str(directory)
    assert "tokenizer not carried" not in imported.stderr
    hint = yaml.safe_load(imported.stderr.split("use these settings in the training config:\n")[1])
    assert hint["model"]["family"] == "bert" and hint["model"]["vocab_size"] == VOCAB
    assert hint["checkpoint"] == {"load": str(directory)}
    assert hint["data"] == {"tokenizer": str(directory / "tokenizer.json")}
    config, weights, step = read_model_weights(root)
    want_config, want_weights = import_bert(hf_dir)
    assert (config, step) == (want_config, 0) and weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)

    # train from it at tp2 x pp2 with the carried tokenizer
    job = {
        **hint,
        "parallel": {"tp": 2, "pp": 2},
        "precision": {"dtype": "fp32"},
        "data": {**hint["data"], "paths": [str(corpus)], "cache_dir": str(tmp_path / "cache"),
                 "valid_fraction": 0.0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "training": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2,
                     "sample_prompt": None},
        "checkpoint": {**hint["checkpoint"], "dir": str(run)},
        "logging": {"interval": 1, "tensorboard_dir": None},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    trained = _run("train", tmp_path / "job.yaml", "--nproc", "4")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert f"checkpoint: model weights from {directory}" in trained.stdout
    assert "tp=2 pp=2" in trained.stdout
    assert [int(m.group(1)) for m in STEP_LINE.finditer(trained.stdout)] == [1, 2, 3]
    mtcore_model, step, saved = load_model(run)
    assert step == STEPS and (saved / "tokenizer.json").is_file()
    moved = [k for k, v in mtcore_model.state_dict().items() if not torch.equal(v, weights[k])]
    assert "embed.word.weight" in moved and "pair.weight" in moved  # it trained

    # export the trained checkpoint: transformers loads it with mtcore's logits
    back = _run("convert", "to-hf", run, out, "--dtype", "fp32")
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB
    reloaded, info = transformers.BertForPreTraining.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info
    fast = transformers.AutoTokenizer.from_pretrained(out)
    assert (fast.cls_token, fast.sep_token, fast.mask_token, fast.pad_token) == (
        "[CLS]", "[SEP]", "[MASK]", "[PAD]",
    )  # fmt: skip
    firsts, seconds = zip(*PAIRS, strict=True)
    enc = fast(
        list(firsts), list(seconds), padding="max_length", max_length=SEQ, return_tensors="pt"
    )
    assert enc["token_type_ids"].any() and not enc["attention_mask"].all()
    for i, (a, b) in enumerate(PAIRS):  # the exported tokenizer encodes like the original
        want = tokenizer.encode(a, b)
        n = len(want.ids)
        assert enc["input_ids"][i, :n].tolist() == want.ids
        assert enc["token_type_ids"][i, :n].tolist() == want.type_ids
        assert enc["attention_mask"][i].sum() == n
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(tokenizer.to_str())
    exported = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "the [MASK] reads a hidden word"
    assert exported.encode(text).ids == tokenizer.encode(text).ids
    assert tokenizer.token_to_id("[MASK]") in exported.encode(text).ids
    inputs = (enc["input_ids"], enc["token_type_ids"], enc["attention_mask"].bool())
    with torch.no_grad():
        want_mlm, want_pair = mtcore_model(*inputs)
    mlm, pair = tiny_bert.logits(reloaded.eval(), *inputs)
    torch.testing.assert_close(mlm, want_mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pair, want_pair, atol=1e-5, rtol=1e-5)
    # and the random ids of the fixture's padded pairs too
    tokens, token_types, padding_mask = tiny_bert.inputs(VOCAB, SEQ)
    with torch.no_grad():
        want_mlm, want_pair = mtcore_model(tokens, token_types, padding_mask)
    mlm, pair = tiny_bert.logits(reloaded, tokens, token_types, padding_mask)
    torch.testing.assert_close(mlm, want_mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pair, want_pair, atol=1e-5, rtol=1e-5)
