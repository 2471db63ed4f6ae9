"""Fixed-length training samples, packed GPT-style across documents, and the split.

The documents of a split are read as one stream (each already ends with the
end-of-document id) and cut into samples of ``seq_len + 1`` tokens: ``[:-1]`` is
the input and ``[1:]`` the target, and consecutive samples share one token, so no
target is lost at the cut. Packing wastes no compute on padding, which matters
more than the small cost of attention crossing a document boundary; the eod token
tells the model where one document ends.

The train/validation split is by document, never by token range, so no document
contributes text to both sides. It is a seeded permutation of document ids with a
fixed seed of its own: changing the training seed reshuffles training order
without moving documents between train and validation, so validation losses stay
comparable across runs.
"""

from __future__ import annotations

import numpy as np

from mtcore.data.cache import DataError
from mtcore.data.indexed import IndexedDataset

SPLIT_SEED = 0x5EED_DA7A


def split_documents(
    num_docs: int, valid_fraction: float, name: str = "data"
) -> tuple[np.ndarray, np.ndarray]:
    """(train doc ids, valid doc ids), each sorted; deterministic in its arguments."""
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    n_valid = round(num_docs * valid_fraction)
    if valid_fraction > 0:
        if num_docs < 2:
            raise DataError(
                f"{name} has {num_docs} document(s): a train/validation split needs at least 2 "
                "(add documents or set valid_fraction=0)"
            )
        n_valid = min(max(n_valid, 1), num_docs - 1)
    perm = np.random.default_rng(SPLIT_SEED).permutation(num_docs)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


class SequenceDataset:
    """``len(self)`` samples of ``seq_len + 1`` token ids from the packed documents ``doc_ids``.

    Documents adjacent in the ``.bin`` are merged into one segment, so a sample is
    usually one memmap slice and at most a few.
    """

    def __init__(
        self, index: IndexedDataset, doc_ids: np.ndarray, seq_len: int, name: str = "data"
    ):
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        doc_ids = np.sort(np.asarray(doc_ids, dtype=np.int64))
        if len(doc_ids) == 0:
            raise DataError(f"{name}: no documents")
        self.index, self.seq_len, self.name = index, seq_len, name
        self.num_docs = len(doc_ids)
        starts, ends = index.offsets[doc_ids], index.offsets[doc_ids + 1]
        cut = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        self._seg_start = starts[np.concatenate([[0], cut])]
        seg_end = ends[np.concatenate([cut - 1, [len(doc_ids) - 1]])]
        self._cum = np.concatenate([[0], np.cumsum(seg_end - self._seg_start)])
        self.num_tokens = int(self._cum[-1])
        self.num_samples = (self.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"{name} has {self.num_tokens} tokens in {self.num_docs} document(s), too few for "
                f"one sample of seq_len + 1 = {seq_len + 1} tokens (add data or lower seq_len)"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: tokens ``[i * seq_len, (i + 1) * seq_len]`` of the stream (inclusive)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"sample {i} out of range for {self.name} ({self.num_samples} samples)"
            )
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len + 1
        seg = int(np.searchsorted(self._cum, lo, side="right")) - 1
        pieces = []
        while lo < hi:
            take = min(hi, int(self._cum[seg + 1])) - lo
            start = int(self._seg_start[seg]) + lo - int(self._cum[seg])
            pieces.append(self.index.tokens[start : start + take])
            lo += take
            seg += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def stream(self) -> np.ndarray:
        """The whole packed token stream of this split (for tests and inspection)."""
        return np.concatenate(
            [
                self.index.tokens[s : s + n]
                for s, n in zip(self._seg_start, np.diff(self._cum), strict=True)
            ]
        )

    def __repr__(self) -> str:
        return (
            f"SequenceDataset({self.name}: {self.num_docs} docs, {self.num_tokens} tokens, "
            f"{self.num_samples} samples of {self.seq_len}+1)"
        )
