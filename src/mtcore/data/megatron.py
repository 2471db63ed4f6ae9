"""Megatron-LM's own ``.bin``/``.idx`` pairs (``MMIDIDX``) as training input, read in place.

A user who preprocessed a corpus with Megatron's ``tools/preprocess_data.py`` (or
wrote it with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``) has
``<prefix>.bin``, the token ids of every sequence back to back, and ``<prefix>.idx``:

    header   magic b"MMIDIDX\\0\\0" (9 bytes) | version u64 = 1 | dtype code u8
             | sequence count u64 | document index count u64
    lengths  int32[sequence count]      tokens per sequence
    pointers int64[sequence count]      byte offset of each sequence in the .bin
    doc idx  int64[document index count] sequence index where each document starts,
                                         then the sequence count (so count = documents + 1)
    (modes   int8[sequence count], multimodal datasets only: not read)

dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.

``MegatronIndexedDataset`` exposes the same ``offsets`` (token offset of each
document) and ``tokens`` (the memory-mapped .bin) as mtcore's ``IndexedDataset``, so
packing, the document split and blending work unchanged. A document is all the
sequences between two document indices (one sequence per document unless the
corpus was preprocessed with ``--split-sentences``). Megatron's packer appends the
end-of-document id only when preprocessing asked for it (``--append-eod``); the
tokens are used as they are, like Megatron's ``GPTDataset`` does.

The file records no vocabulary, so opening takes the tokenizer's size and refuses
a file with an id outside it (under tensor parallelism such an id would embed to
zeros and train on nothing, silently).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from mtcore.data.cache import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}  # 6 and 7 (float64, float32) hold no token ids


def is_megatron_index(idx_path: Path) -> bool:
    """Whether ``idx_path`` starts with Megatron's ``MMIDIDX`` magic."""
    with open(idx_path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _bad(path: Path, why: str) -> DataError:
    return DataError(f"Megatron token index {path} cannot be read: {why}")


class MegatronIndexedDataset:
    """The documents of a Megatron ``.bin``/``.idx`` pair as slices of the mapped tokens."""

    def __init__(self, prefix: str | Path, vocab_size: int | None = None):
        self.prefix = Path(prefix)
        self.idx_path = self.prefix.with_name(self.prefix.name + ".idx")
        self.bin_path = self.prefix.with_name(self.prefix.name + ".bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"Megatron token file does not exist: {path}")
        self.dtype, lengths, pointers, doc_idx = _read_index(self.idx_path)
        total = int(lengths.sum(dtype=np.int64))
        expected = total * self.dtype.itemsize
        if self.bin_path.stat().st_size != expected:
            raise _bad(
                self.bin_path,
                f"{self.bin_path.stat().st_size} bytes, but {self.idx_path.name} describes "
                f"{total} tokens of {self.dtype} ({expected} bytes)",
            )
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        if not np.array_equal(pointers, starts[:-1] * self.dtype.itemsize):
            raise _bad(self.idx_path, "its sequences are not stored back to back in the .bin")
        # Token offset of each document's first sequence, then the total.
        self.offsets = starts[doc_idx]
        self.tokens = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r")
            if total
            else np.empty(0, self.dtype)
        )
        self.sequence_lengths = lengths
        self._check_ids(vocab_size)

    def _check_ids(self, vocab_size: int | None) -> None:
        if self.num_tokens == 0:
            raise _bad(self.bin_path, "it holds no tokens")
        lowest, highest = int(self.tokens.min()), int(self.tokens.max())
        if lowest < 0:
            raise _bad(self.bin_path, f"it holds the negative token id {lowest}")
        if vocab_size is not None and highest >= vocab_size:
            raise DataError(
                f"Megatron token file {self.bin_path} holds ids up to {highest}, but the "
                f"tokenizer has {vocab_size} ids: give data.tokenizer the tokenizer.json the "
                "data was preprocessed with"
            )
        self.max_id = highest

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def __repr__(self) -> str:
        return f"MegatronIndexedDataset({self.prefix}: {len(self)} docs, {self.num_tokens} tokens)"


def _read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence pointers, document indices), validated."""
    size = path.stat().st_size
    if size < _HEADER.size:
        raise _bad(path, f"{size} bytes is shorter than the {_HEADER.size}-byte header")
    with open(path, "rb") as f:
        magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise _bad(path, f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise _bad(path, f"format version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise _bad(path, f"token dtype code {code} is not an integer type")
        body = 4 * n_seq + 8 * n_seq + 8 * n_doc_idx
        if size not in (_HEADER.size + body, _HEADER.size + body + n_seq):  # + modes
            raise _bad(
                path, f"{size} bytes do not fit {n_seq} sequences and {n_doc_idx} document indices"
            )
        lengths = np.fromfile(f, dtype="<i4", count=n_seq).astype(np.int64)
        pointers = np.fromfile(f, dtype="<i8", count=n_seq)
        doc_idx = np.fromfile(f, dtype="<i8", count=n_doc_idx)
    if n_doc_idx < 2 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        raise _bad(path, "its document indices do not run from 0 to the sequence count")
    if np.any(lengths < 0):
        raise _bad(path, "it records a negative sequence length")
    return DTYPES[code], lengths, pointers, doc_idx
