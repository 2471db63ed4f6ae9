"""BERT training data: segments cut on line boundaries, and the sentence-pair table over them.

The documents are the GPT pipeline's (same sources, same cached ``.bin``/``.idx``
index, same train/validation split by document); only how samples are cut differs.

*Segments.* Each document (its trailing end-of-document id dropped) is cut into
segments of whole lines: a line ends after any token whose text holds a newline,
and consecutive lines are packed greedily into one segment while it stays within
the segment budget. A single line longer than the budget is cut every ``budget``
tokens (so are documents of a tokenizer with no newline tokens, e.g. WordPiece).
The budget is ``(seq_len - 3) // 2`` for pair tasks and ``seq_len - 2`` for
``"none"``: any two segments then fit ``[CLS] A [SEP] B [SEP]`` as they are, so no
pair is ever truncated and no token is thrown away; shorter sequences are padded.

*Pairs.* Every segment that has a successor in its document starts one sample.
``"nsp"``: B is that successor (label 0) or, with probability 1/2, a random segment
of another document of the same split (label 1), HF's ``next_sentence_label``
convention. ``"sop"``: A, B in document order (label 0) or swapped (label 1).
``"none"``: every segment is one sample, ``[CLS] A [SEP]``. The table is drawn once
from ``seed`` and the data, with numpy in a few vectorised passes (a Python loop
runs over lines only), so the default corpus builds in well under a second.

Masking is not done here but in ``PairLoader`` (``pair_loader.py``, re-exported
here): it depends on the epoch a sample is drawn in, so each epoch sees fresh masks.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import numpy as np

from mtcore.data.blend import BlendedDataset
from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig
from mtcore.data.indexed import IndexedDataset
from mtcore.data.splits import config_sources, train_and_valid
from mtcore.data.tokenizer import Tokenizer, get_tokenizer
from mtcore.models.bert.names import BERT_SPECIAL_TOKENS
from mtcore.models.bert.pair_loader import PairLoader, mask_sequence
from mtcore.models.bert.vocab import PairVocab

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "PAIR_TASKS",
    "PairBlend",
    "PairData",
    "PairDataset",
    "PairLoader",
    "PairSample",
    "PairVocab",
    "build_pair_data",
    "mask_sequence",
]

log = logging.getLogger(__name__)

PAIR_TASKS = ("nsp", "sop", "none")
_PAIR_TABLE_SALT = 0xB3A7_2A15  # keeps the pair draws apart from other streams of one seed


def min_seq_len(pair_task: str) -> int:
    """``[CLS] a [SEP] b [SEP]`` needs 5 positions, ``[CLS] a [SEP]`` needs 3."""
    return 3 if pair_task == "none" else 5


def check_pair_args(seq_len: int, pair_task: str) -> None:
    if pair_task not in PAIR_TASKS:
        raise DataError(f"pair_task must be one of {PAIR_TASKS}, got {pair_task!r}")
    if seq_len < min_seq_len(pair_task):
        layout = "[CLS] a [SEP]" if pair_task == "none" else "[CLS] a [SEP] b [SEP]"
        raise DataError(
            f"seq_len={seq_len} is too short for {layout}: pair_task={pair_task!r} needs "
            f"seq_len >= {min_seq_len(pair_task)}"
        )


class PairSample(NamedTuple):
    """One unmasked sequence: ``seq_len`` ids ([PAD]-padded), token types, real length, label."""

    tokens: np.ndarray
    token_types: np.ndarray
    length: int
    pair_label: int  # -1 for pair_task "none"


def cut_segments(num_tokens: int, line_ends: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Greedy packing of whole lines into ``[start, end)`` runs of at most ``budget`` tokens.

    ``line_ends`` are the offsets just past each line's last token, increasing; the
    text after the last one is a final line.
    """
    bounds: list[tuple[int, int]] = []
    start = last = 0
    for end in [*line_ends.tolist(), num_tokens]:
        if end <= last:
            continue
        if end - start > budget and last > start:  # close at the previous line end
            bounds.append((start, last))
            start = last
        while end - start > budget:  # one line longer than the budget: hard cuts
            bounds.append((start, start + budget))
            start += budget
        last = end
    if last > start:
        bounds.append((start, last))
    return bounds


class PairDataset:
    """The pair (or single-segment) samples of documents ``doc_ids`` of ``index``."""

    def __init__(
        self,
        index: IndexedDataset,
        doc_ids: np.ndarray,
        vocab: PairVocab,
        seq_len: int,
        pair_task: str = "nsp",
        seed: int = 0,
        name: str = "data",
    ):
        check_pair_args(seq_len, pair_task)
        self.index, self.vocab, self.name = index, vocab, name
        self.seq_len, self.pair_task, self.seed = seq_len, pair_task, seed
        self.doc_ids = np.sort(np.asarray(doc_ids, dtype=np.int64))
        self.budget = seq_len - 2 if pair_task == "none" else (seq_len - 3) // 2
        self._build_segments()
        self._build_table()

    def _build_segments(self) -> None:
        starts, ends, docs = [], [], []
        for position, doc in enumerate(self.doc_ids.tolist()):
            offset = int(self.index.offsets[doc])
            content = self.index.document(doc)[:-1]  # without the end-of-document id
            line_ends = np.flatnonzero(self.vocab.ends_line[content]) + 1
            for start, end in cut_segments(len(content), line_ends, self.budget):
                starts.append(offset + start)
                ends.append(offset + end)
                docs.append(position)
        self.segment_start = np.array(starts, dtype=np.int64)
        self.segment_end = np.array(ends, dtype=np.int64)
        self.segment_doc = np.array(docs, dtype=np.int64)  # position in self.doc_ids
        self.num_tokens = int((self.segment_end - self.segment_start).sum())

    def _too_small(self, why: str) -> DataError:
        return DataError(
            f"{self.name} has {len(self.doc_ids)} document(s), {self.num_tokens} tokens, cut into "
            f"{len(self.segment_start)} segment(s) of at most {self.budget} tokens for "
            f"seq_len={self.seq_len}: {why} (add data or lower seq_len)"
        )

    def _build_table(self) -> None:
        if self.pair_task == "none":
            if len(self.segment_start) == 0:
                raise self._too_small("too few for one sample")
            self.first_segment = np.arange(len(self.segment_start), dtype=np.int64)
            self.second_segment = np.full_like(self.first_segment, -1)
            self.pair_label = np.full_like(self.first_segment, -1)
            return
        has_next = np.flatnonzero(self.segment_doc[1:] == self.segment_doc[:-1])
        if len(has_next) == 0:
            raise self._too_small("no document has two segments, too few for one pair")
        rng = np.random.default_rng([self.seed, _PAIR_TABLE_SALT])
        first, second = has_next, has_next + 1
        label = (rng.random(len(first)) < 0.5).astype(np.int64)
        if self.pair_task == "sop":
            first, second = np.where(label == 1, second, first), np.where(label == 1, first, second)
        else:
            second = np.where(label == 1, self._random_other_segments(first, rng), second)
        self.first_segment, self.second_segment, self.pair_label = first, second, label

    def _random_other_segments(self, first: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """For each segment in ``first``: a uniform document other than its own, then a
        uniform segment of that document."""
        docs_with_segments, doc_first = np.unique(self.segment_doc, return_index=True)
        if len(docs_with_segments) < 2:
            raise self._too_small(
                f"nsp draws B from another document, but only {len(docs_with_segments)} "
                "document(s) hold a segment"
            )
        doc_count = np.diff(np.append(doc_first, len(self.segment_doc)))
        own = np.searchsorted(docs_with_segments, self.segment_doc[first])
        other = rng.integers(0, len(docs_with_segments) - 1, size=len(first))
        other += other >= own
        within = (rng.random(len(first)) * doc_count[other]).astype(np.int64)
        return doc_first[other] + within

    def segment_tokens(self, segment: int) -> np.ndarray:
        return self.index.tokens[self.segment_start[segment] : self.segment_end[segment]]

    def __len__(self) -> int:
        return len(self.first_segment)

    def __getitem__(self, i: int) -> PairSample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.name} ({len(self)} samples)")
        vocab = self.vocab
        tokens = np.full(self.seq_len, vocab.pad_id, dtype=np.int64)
        token_types = np.zeros(self.seq_len, dtype=np.int64)
        first = self.segment_tokens(self.first_segment[i])
        tokens[0] = vocab.cls_id
        tokens[1 : 1 + len(first)] = first
        tokens[1 + len(first)] = vocab.sep_id
        length = 2 + len(first)
        if self.second_segment[i] >= 0:
            second = self.segment_tokens(self.second_segment[i])
            tokens[length : length + len(second)] = second
            tokens[length + len(second)] = vocab.sep_id
            token_types[length : length + len(second) + 1] = 1
            length += len(second) + 1
        return PairSample(tokens, token_types, length, int(self.pair_label[i]))

    def __repr__(self) -> str:
        return (
            f"PairDataset({self.name}: {len(self.doc_ids)} docs, {len(self.segment_start)} "
            f"segments, {len(self)} {self.pair_task} samples of {self.seq_len})"
        )


class PairBlend(BlendedDataset):
    """Pair datasets of several data paths, blended by weight like the GPT ones."""

    def __init__(self, datasets: list[PairDataset], weights: list[float], name: str):
        super().__init__(datasets, weights, name=name)
        self.pair_task, self.vocab = datasets[0].pair_task, datasets[0].vocab


class PairData(NamedTuple):
    tokenizer: Tokenizer
    train: PairDataset | PairBlend
    valid: PairDataset | PairBlend | None  # None when valid_fraction == 0


def build_pair_data(
    config: DataConfig, seq_len: int, pair_task: str = "nsp", seed: int = 0
) -> PairData:
    """Tokenizer (with ``BERT_SPECIAL_TOKENS``) and train/valid pair datasets for ``config``.

    ``seq_len`` is the BERT sequence length (``config.seq_len`` is the GPT one and is
    not used); ``seed`` draws the pair table. Cached files are shared with nothing
    GPT builds: the tokenizer differs, so does its index.
    """
    check_pair_args(seq_len, pair_task)
    start = time.perf_counter()
    cache_dir = config.resolved_cache_dir()
    sources, all_files = config_sources(config)
    tokenizer = get_tokenizer(
        all_files, cache_dir, config.vocab_size, config.tokenizer, config.text_key,
        special_tokens=BERT_SPECIAL_TOKENS,
    )  # fmt: skip
    vocab = PairVocab.from_tokenizer(tokenizer)

    def samples(index, doc_ids, name):
        return PairDataset(index, doc_ids, vocab, seq_len, pair_task, seed, name)

    train, valid = train_and_valid(config, sources, tokenizer, cache_dir, samples, PairBlend)
    log.info(
        "pair data ready in %.1f s: %s; train %s; valid %s",
        time.perf_counter() - start, tokenizer, train, valid,
    )  # fmt: skip
    return PairData(tokenizer, train, valid)
