"""The .bin/.idx token index: built once, equal to direct encoding, loud about corruption."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from mtcore.data import indexed as indexed_mod
from mtcore.data.cache import DataError
from mtcore.data.corpus import find_files, iter_documents
from mtcore.data.indexed import (
    MAGIC,
    IndexedDataset,
    get_indexed_dataset,
    token_dtype,
    write_index,
)


@pytest.fixture
def built(trained, tmp_path):
    tok, root = trained
    files = find_files(root)
    return tok, files, get_indexed_dataset(files, tok, tmp_path / "cache", "corpus")


def test_content_equals_direct_encoding(built):
    tok, files, ds = built
    docs = list(iter_documents(files))
    assert len(ds) == len(docs) == len(files)
    assert ds.tokens.dtype == np.uint16
    for i, doc in enumerate(docs):
        assert ds.document(i).tolist() == [*tok.encode(doc), tok.eod_id]
    assert ds.num_tokens == sum(len(tok.encode(d)) + 1 for d in docs)


def test_built_once_then_reused(built, monkeypatch):
    tok, files, ds = built
    stamps = [p.stat().st_mtime_ns for p in (ds.bin_path, ds.idx_path)]
    monkeypatch.setattr(
        indexed_mod, "build_indexed_dataset", lambda *a, **k: pytest.fail("rebuilt")
    )
    again = get_indexed_dataset(files, tok, ds.prefix.parent, "corpus")
    assert again.prefix == ds.prefix
    assert [p.stat().st_mtime_ns for p in (ds.bin_path, ds.idx_path)] == stamps
    assert not list(ds.prefix.parent.glob(".*tmp*"))  # no temporary files left behind


def test_token_dtype_widens_for_large_vocabularies(tmp_path):
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.int32
    prefix = tmp_path / "big"
    tokens = np.array([70000, 1, 0, 65536, 0], dtype=np.int32)
    tokens.tofile(tmp_path / "big.bin")
    write_index(
        tmp_path / "big.idx",
        np.array([0, 3, 5]),
        np.dtype(np.int32),
        vocab_size=70001,
        max_id=70000,
    )
    ds = IndexedDataset(prefix)
    assert ds.document(0).tolist() == [70000, 1, 0] and ds.document(1).tolist() == [65536, 0]


def _header(path):
    return bytearray(path.read_bytes())


def _bad_magic(ds):
    data = _header(ds.idx_path)
    data[:8] = b"NOTMAGIC"
    ds.idx_path.write_bytes(bytes(data))


def _bad_version(ds):
    data = _header(ds.idx_path)
    data[8:12] = struct.pack("<I", 99)
    ds.idx_path.write_bytes(bytes(data))


def _truncated_idx(ds):
    ds.idx_path.write_bytes(ds.idx_path.read_bytes()[:-5])


def _short_idx(ds):
    ds.idx_path.write_bytes(MAGIC)


def _max_id_beyond_vocab(ds):
    data = _header(ds.idx_path)
    data[24:40] = struct.pack("<QQ", 400, 400)  # vocab size, max id
    ds.idx_path.write_bytes(bytes(data))


def _truncated_bin(ds):
    ds.bin_path.write_bytes(ds.bin_path.read_bytes()[:-4])


def _grown_bin(ds):
    ds.bin_path.write_bytes(ds.bin_path.read_bytes() + b"\0\0")


def _decreasing_offsets(ds):
    data = _header(ds.idx_path)
    at = indexed_mod._HEADER.size + 8
    data[at : at + 8] = struct.pack("<q", 10**6)
    ds.idx_path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "corrupt, which, why",
    [
        (_bad_magic, "idx", "bad magic"),
        (_bad_version, "idx", "version 99"),
        (_truncated_idx, "idx", "expected"),
        (_short_idx, "idx", "header"),
        (_decreasing_offsets, "idx", "offsets"),
        (_max_id_beyond_vocab, "idx", "max token id 400 is outside its vocabulary of 400"),
        (_truncated_bin, "bin", "beyond the end"),
        (_grown_bin, "bin", "short of the end"),
    ],
)
def test_corrupt_files_are_named(built, corrupt, which, why):
    tok, files, ds = built
    corrupt(ds)
    path = ds.idx_path if which == "idx" else ds.bin_path
    with pytest.raises(DataError, match=why) as err:
        get_indexed_dataset(files, tok, ds.prefix.parent, "corpus")
    assert str(path) in str(err.value)


def test_missing_bin_is_named(built):
    _, _, ds = built
    ds.bin_path.unlink()
    with pytest.raises(DataError, match=re.escape(str(ds.bin_path))):
        IndexedDataset(ds.prefix)


def test_missing_and_empty_paths_are_named(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "absent"))):
        find_files(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "empty"))):
        find_files(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match=r"blank.*empty"):
        find_files(tmp_path / "blank")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=re.escape("x.csv")):
        find_files(tmp_path / "x.csv")


def test_jsonl_documents(trained, tmp_path):
    tok, _ = trained
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "alpha beta"}\n\n{"content": "gamma", "id": 2}\n{"content": ""}\n')
    ds = get_indexed_dataset(find_files(path), tok, tmp_path / "cache", "docs", text_key="content")
    assert len(ds) == 2
    assert tok.decode(ds.document(0)) == "alpha beta" + "<|endoftext|>"
    path.write_text('{"content": "ok"}\n{"text": "wrong key"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2") + ".*'content'"):
        list(iter_documents([path], "content"))
    path.write_text("{oops\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:1")):
        list(iter_documents([path]))
