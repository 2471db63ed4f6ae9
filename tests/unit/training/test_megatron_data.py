"""Megatron-LM's MMIDIDX ``.bin``/``.idx`` pairs train directly, blended as ``--data-path``.

The files come from two writers: a small one of the documented format below (always),
and Megatron-Core's own ``IndexedDatasetBuilder`` when megatron-core is installed. The
token stream mtcore reads must equal what each writer wrote and, with megatron-core,
what Megatron's own reader returns.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest

from mtcore.data import DataConfig, DataError, build_datasets
from mtcore.data.indexed import open_token_index
from mtcore.data.megatron import MegatronIndexedDataset
from mtcore.data.tokenizer import train_tokenizer
from mtcore.training.config import TrainConfig
from mtcore.training.trainer import train

_CODES = {np.uint16: 8, np.int32: 4, np.int64: 5, np.uint8: 1}


def write_mmidx(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16) -> None:
    """Documents (each a list of sequences of ids) as Megatron's documented MMIDIDX pair."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = (
        np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    )
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    prefix.with_suffix(".bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", _CODES[dtype]))
        f.write(struct.pack("<QQ", len(sequences), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_idx.tobytes())


def random_documents(seed: int, n_docs: int, vocab: int, eod: int) -> list[list[list[int]]]:
    """Documents of one to three sequences, each document ending with ``eod``."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        seqs = [
            rng.integers(1, vocab, rng.integers(5, 40)).tolist() for _ in range(rng.integers(1, 4))
        ]
        seqs[-1].append(eod)
        docs.append(seqs)
    return docs


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A 300-id BPE: the vocabulary the Megatron files' ids must fit."""
    words = [f"w{i} x{i % 7} def y{i % 13}" for i in range(400)]
    hf = train_tokenizer(words, 300)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(hf.to_str())
    return path


def test_reader_gives_the_written_documents(tmp_path):
    docs = random_documents(0, 30, 300, eod=0)
    write_mmidx(tmp_path / "corpus_text_document", docs)
    ds = open_token_index(tmp_path / "corpus_text_document", vocab_size=300)
    assert isinstance(ds, MegatronIndexedDataset)
    assert len(ds) == 30
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document(i), np.concatenate(doc))


def test_int32_files_and_an_id_outside_the_vocabulary(tmp_path):
    write_mmidx(tmp_path / "big", [[[1, 2, 70000]], [[5, 6]]], dtype=np.int32)
    assert MegatronIndexedDataset(tmp_path / "big", vocab_size=70001).max_id == 70000
    with pytest.raises(DataError, match=r"holds ids up to 70000, but the tokenizer has 300 ids"):
        MegatronIndexedDataset(tmp_path / "big", vocab_size=300)


def test_damaged_files_are_refused_by_name(tmp_path):
    write_mmidx(tmp_path / "d", random_documents(1, 5, 300, eod=0))
    bin_path = tmp_path / "d.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"d\.bin cannot be read: .* bytes, but d\.idx describes"):
        MegatronIndexedDataset(tmp_path / "d")
    idx = tmp_path / "d.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"d\.idx cannot be read: .* do not fit"):
        MegatronIndexedDataset(tmp_path / "d")


def test_megatron_data_path_form_blends_by_weight(tmp_path, tokenizer_json):
    for name, seed in (("a", 1), ("b", 2)):
        write_mmidx(tmp_path / name, random_documents(seed, 40, 300, eod=0))
    paths = [0.25, str(tmp_path / "a"), "0.75", str(tmp_path / "b.idx")]
    config = DataConfig(paths=paths, tokenizer=str(tokenizer_json), seq_len=16, valid_fraction=0)
    assert config.paths == [str(tmp_path / "a"), str(tmp_path / "b.idx")]
    assert config.weights == [0.25, 0.75]
    data = build_datasets(config)
    counts = np.bincount(data.train.dataset_index, minlength=2) / len(data.train)
    np.testing.assert_allclose(counts, [0.25, 0.75], atol=0.01)


def test_pretokenized_data_needs_its_tokenizer(tmp_path):
    write_mmidx(tmp_path / "a", random_documents(1, 4, 300, eod=0))
    with pytest.raises(DataError, match=r"already tokenized .* set data.tokenizer"):
        build_datasets(DataConfig(paths=[str(tmp_path / "a")], seq_len=8))
    with pytest.raises(ValueError, match="mixes weights and paths"):
        DataConfig(paths=[0.5, str(tmp_path / "a"), str(tmp_path / "a")])


def _train_on(prefixes: list[str], tokenizer_json: Path, tiny) -> list[float]:
    config = tiny(
        data=dict(paths=prefixes, tokenizer=str(tokenizer_json)),
        training=dict(steps=3, eval_interval=0, sample_tokens=0),
    )
    result = train(TrainConfig.model_validate(config), stream=io.StringIO())
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))
    return result.losses


def test_trains_on_documented_format_files(tmp_path, tokenizer_json, tiny):
    write_mmidx(tmp_path / "m_text_document", random_documents(3, 60, 300, eod=0))
    losses = _train_on([str(tmp_path / "m_text_document")], tokenizer_json, tiny)
    assert losses[-1] < losses[0] + 1.0


def test_megatron_cores_writer_and_reader_agree_with_mtcore(tmp_path, tokenizer_json, tiny):
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = random_documents(4, 50, 300, eod=0)
    prefix = str(tmp_path / "core_text_document")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    theirs = indexed.IndexedDataset(prefix)
    ours = MegatronIndexedDataset(prefix, vocab_size=300)
    np.testing.assert_array_equal(
        ours.offsets, np.concatenate([[0], np.cumsum([sum(map(len, d)) for d in docs])])
    )
    stream = np.concatenate([theirs[i] for i in range(len(theirs))])
    np.testing.assert_array_equal(np.asarray(ours.tokens), stream)
    for d in range(len(docs)):  # documents: their sequences between two document indices
        lo, hi = theirs.document_indices[d], theirs.document_indices[d + 1]
        np.testing.assert_array_equal(
            ours.document(d), np.concatenate([theirs[i] for i in range(lo, hi)])
        )
    # mtcore's packed training stream over all documents is Megatron's token stream.
    data = build_datasets(
        DataConfig(paths=[prefix], tokenizer=str(tokenizer_json), seq_len=16, valid_fraction=0)
    )
    np.testing.assert_array_equal(data.train.stream(), stream)
    _train_on([0.5, prefix, 0.5, prefix], tokenizer_json, tiny)
