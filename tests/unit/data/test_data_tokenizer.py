"""Tokenizer: trains a byte-level BPE once per corpus, round-trips text, honours the vocab size."""

from __future__ import annotations

import re

import pytest

from mtcore.data import tokenizer as tokenizer_mod
from mtcore.data.cache import DataError
from mtcore.data.corpus import find_files
from mtcore.data.tokenizer import EOD_TOKEN, get_tokenizer, load_tokenizer


def test_trains_round_trips_and_honours_vocab_size(trained):
    tok, _ = trained
    assert tok.vocab_size == 400
    assert tok.eod_id == 0 and tok.decode([tok.eod_id]) == EOD_TOKEN
    for text in ["def rank(shard):\n    return seed + 1\n", "naïve 例子 ✓ \t\x00 tail", ""]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(["alpha beta", "gamma"]) == [
        tok.encode("alpha beta"),
        tok.encode("gamma"),
    ]


def test_literal_eod_text_is_not_a_document_break(trained):
    tok, _ = trained
    ids = tok.encode(f"a{EOD_TOKEN}b")
    assert tok.eod_id not in ids
    assert tok.decode(ids) == f"a{EOD_TOKEN}b"


def test_cache_is_reused_and_a_changed_corpus_retrains(corpus, cache, monkeypatch):
    calls = []
    real = tokenizer_mod.train_tokenizer
    monkeypatch.setattr(
        tokenizer_mod, "train_tokenizer", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    first = get_tokenizer(find_files(corpus), cache, vocab_size=300)
    mtime = first.path.stat().st_mtime_ns
    second = get_tokenizer(find_files(corpus), cache, vocab_size=300)
    assert len(calls) == 1 and second.path == first.path and first.path.stat().st_mtime_ns == mtime
    assert second.vocab_size == 300

    third = get_tokenizer(find_files(corpus), cache, vocab_size=320)  # other vocab size
    assert len(calls) == 2 and third.path != first.path and third.vocab_size == 320

    (corpus / "doc00.py").write_text("changed = True\n" * 50)
    fourth = get_tokenizer(find_files(corpus), cache, vocab_size=300)
    assert len(calls) == 3 and fourth.path not in (first.path, third.path)


def test_loads_a_tokenizer_json(trained, tmp_path):
    tok, _ = trained
    copy = tmp_path / "tokenizer.json"
    copy.write_text(tok.hf.to_str())
    loaded = get_tokenizer([], tmp_path / "unused", vocab_size=999, tokenizer_path=copy)
    assert loaded.vocab_size == tok.vocab_size and loaded.encode("alpha rank") == tok.encode(
        "alpha rank"
    )
    assert not (tmp_path / "unused").exists()


def test_bad_tokenizer_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "nope.json"))):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(DataError, match=re.escape("junk.json")):
        load_tokenizer(tmp_path / "junk.json")


def test_small_corpus_warns_when_vocab_cannot_be_reached(tmp_path, make_corpus):
    root = make_corpus(tmp_path / "c", n_docs=1)
    with pytest.warns(UserWarning, match="vocab_size=5000"):
        tok = get_tokenizer(find_files(root), tmp_path / "cache", vocab_size=5000)
    assert 257 <= tok.vocab_size < 5000
