"""Token ids outside the vocabulary never reach training: the index records and checks them.

Issue 13: a cached ``.bin`` overwritten with 0xFF bytes (same size) trained at tp 2 with
the loss stuck at ln V. The index records the vocabulary size and the max id at build
time, and opening it compares both with the tokenizer and with the mapped tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from mtcore.data.cache import DataError
from mtcore.data.corpus import find_files
from mtcore.data.indexed import IndexedDataset, build_indexed_dataset, get_indexed_dataset


@pytest.fixture
def built(trained, tmp_path):
    tok, root = trained
    files = find_files(root)
    return tok, files, get_indexed_dataset(files, tok, tmp_path / "cache", "corpus")


def test_build_records_vocab_size_and_max_id(built):
    tok, _, ds = built
    assert ds.header.vocab_size == tok.vocab_size
    assert ds.header.max_id == int(np.max(ds.tokens)) < tok.vocab_size


@pytest.mark.parametrize("fill, bad_id", [(0xFF, 65535), (0x00, 0)])
def test_overwritten_bin_is_refused_naming_the_file(built, fill, bad_id):
    tok, files, ds = built
    size = ds.bin_path.stat().st_size
    ds.bin_path.write_bytes(bytes([fill]) * size)  # same size: the size check passes
    with pytest.raises(DataError) as err:
        get_indexed_dataset(files, tok, ds.prefix.parent, "corpus")
    msg = str(err.value)
    assert str(ds.bin_path) in msg and f"token id {bad_id}" in msg
    assert f"max id of {ds.header.max_id}" in msg and f"vocabulary of {tok.vocab_size}" in msg
    assert "delete" in msg


def test_tokenizer_smaller_than_the_recorded_ids_is_refused(built):
    _, _, ds = built
    small = ds.header.max_id  # ids up to max_id need max_id + 1 entries
    with pytest.raises(DataError, match=re.escape(str(ds.idx_path))) as err:
        IndexedDataset(ds.prefix, vocab_size=small)
    assert f"ids up to {ds.header.max_id}" in str(err.value) and f"has {small} ids" in str(
        err.value
    )
    IndexedDataset(ds.prefix, vocab_size=small + 1)  # exactly large enough: accepted


def test_negative_int32_id_is_refused(tmp_path):
    ds = build_indexed_dataset(tmp_path / "wide", ["alpha beta"], _WideTokenizer([3, 1]))
    tokens = np.fromfile(ds.bin_path, dtype=np.int32)
    tokens[0] = -1
    tokens.tofile(ds.bin_path)
    with pytest.raises(DataError, match=r"token id -1"):
        IndexedDataset(ds.prefix)


def test_build_refuses_a_tokenizer_that_emits_ids_outside_its_vocabulary(tmp_path):
    with pytest.raises(DataError, match=r"id 70000 .* vocabulary of 70000 ids"):
        build_indexed_dataset(tmp_path / "bad", ["x"], _WideTokenizer([5, 70000]))
    assert not (tmp_path / "bad.idx").exists() and not (tmp_path / "bad.bin").exists()


class _WideTokenizer:
    """Encodes every document to ``ids``; a vocabulary too large for uint16."""

    vocab_size = 70000
    eod_id = 0

    def __init__(self, ids):
        self.ids = ids

    def encode_batch(self, batch):
        return [list(self.ids) for _ in batch]
