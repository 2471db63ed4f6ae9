"""The public entry point: config, default corpus, multi-path blends and JSONL input."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mtcore.data import (
    BlendedDataset,
    DataConfig,
    DataError,
    SequenceDataset,
    TokenLoader,
    build_datasets,
)
from mtcore.data.corpus import stdlib_files


def test_stdlib_corpus_is_sorted_capped_and_skips_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(max_bytes=300_000)
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert sum(p.stat().st_size for p in files[:-1]) < 300_000
    everything = stdlib_files(max_bytes=None)
    skipped = {"test", "tests", "site-packages"}
    assert not [p for p in everything if skipped & set(p.relative_to(root).parts)]
    assert stdlib_files(max_bytes=None, max_files=3) == everything[:3]


def test_default_corpus_end_to_end(tmp_path):
    tok, train, valid = build_datasets(
        cache_dir=str(tmp_path),
        default_corpus_files=12,
        vocab_size=512,
        seq_len=64,
        valid_fraction=0.2,
    )
    assert tok.vocab_size == 512 and isinstance(train, SequenceDataset) and valid is not None
    assert train.name == "stdlib/train" and len(train) > len(valid) > 0
    tokens, _ = next(TokenLoader(train, micro_batch_size=2, seed=0))
    assert tokens.shape == (2, 64) and int(tokens.max()) < tok.vocab_size
    assert "def " in tok.decode(train.stream()[:5000].tolist())
    cached = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert len(cached) == 3  # tokenizer json, .bin, .idx
    again = build_datasets(
        cache_dir=str(tmp_path),
        default_corpus_files=12,
        vocab_size=512,
        seq_len=64,
        valid_fraction=0.2,
    )
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == cached
    assert torch.equal(
        torch.from_numpy(again.train[3].astype("int64")), torch.from_numpy(train[3].astype("int64"))
    )


def test_jsonl_and_text_paths_blend_by_weight(tmp_path, make_corpus):
    jsonl = tmp_path / "web.jsonl"
    jsonl.write_text(
        "".join(f'{{"body": "record {i} alpha beta gamma {i * 7}"}}\n' for i in range(300))
    )
    code = make_corpus(tmp_path / "code", n_docs=9)
    tok, train, valid = build_datasets(
        paths=[str(code), str(jsonl)], weights=[3, 1], text_key="body", vocab_size=300,
        seq_len=16, valid_fraction=0.1, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert isinstance(train, BlendedDataset) and [d.name for d in train.datasets] == [
        "code/train",
        "web/train",
    ]
    share = (train.dataset_index == 0).mean()
    assert abs(share - 0.75) < 0.01
    assert "record" in tok.decode(train.datasets[1][0].tolist())
    assert isinstance(valid, BlendedDataset)


def test_config_is_validated_and_paths_are_named(tmp_path):
    with pytest.raises(ValidationError, match="extra"):
        DataConfig(sed=1)
    with pytest.raises(ValidationError, match="2 weights for 1 data path"):
        DataConfig(paths=["a"], weights=[1, 2])
    with pytest.raises(ValidationError):
        DataConfig(vocab_size=100)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "missing"))):
        build_datasets(paths=[str(tmp_path / "missing")], cache_dir=str(tmp_path / "cache"))
    (tmp_path / "void").mkdir()
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "void"))):
        build_datasets(paths=[str(tmp_path / "void")], cache_dir=str(tmp_path / "cache"))
