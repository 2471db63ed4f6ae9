"""T5 training data: span corruption (Raffel et al. 2020, section 3.1.4 and 3.3.2).

The documents are the GPT pipeline's (same sources, the embedded corpus by default,
same train/validation split by document), tokenized with a tokenizer that holds T5's
special tokens: ``<pad>``, ``</s>`` and ``NUM_SENTINELS`` sentinels ``<extra_id_k>``.

*Pieces.* Each document (its end-of-document id dropped) is cut into pieces of
``raw_len`` tokens, never across a document's end; its last piece may be shorter
(those samples are padded) and a piece of one token is dropped (it has no span to
corrupt). ``raw_len`` is the longest piece whose corrupted input fits the encoder
length and whose target fits the decoder length (``span_lengths``).

*Corruption.* ``round(length * noise_density)`` tokens of a piece are noise, in
``round(noise / mean_span_length)`` spans; the span lengths and the lengths of the
kept runs between them are random compositions, and the piece starts with a kept
run (T5's ``random_spans_noise_mask``). The input replaces noise span ``k`` with
sentinel ``k``; the target is sentinel ``k`` followed by span ``k``, for every span;
both end with ``</s>``. The draws come from ``(seed, epoch the sample is drawn in,
sample index)``, so batches are deterministic, every epoch corrupts afresh, and a
loader restored from ``state_dict`` continues exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from mtcore.data.blend import BlendedDataset
from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig
from mtcore.data.indexed import IndexedDataset
from mtcore.data.loader import TokenLoader
from mtcore.data.splits import config_sources, train_and_valid
from mtcore.data.tokenizer import Tokenizer, get_tokenizer
from mtcore.models.t5.names import EOS_TOKEN, PAD_TOKEN, SENTINEL_TOKENS, T5_SPECIAL_TOKENS
from mtcore.models.t5.spans import SpanLengths, span_counts, span_lengths

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_SPAN_SALT = 0x5A17_C0DE  # keeps span draws apart from the sampler's (seed, epoch) stream


def _composition(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` positive integers summing to ``total``, uniform over such compositions."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def noise_mask(
    length: int, noise_density: float, mean_span_length: float, rng: np.random.Generator
) -> np.ndarray:
    """Bool ``[length]``, True on noise: kept run, span, kept run, span, ... (starts kept)."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    runs = np.stack(
        [_composition(length - noise, spans, rng), _composition(noise, spans, rng)], axis=1
    ).reshape(-1)
    is_noise = np.tile([False, True], spans)
    return np.repeat(is_noise, runs)


def corrupt(
    tokens: np.ndarray, mask: np.ndarray, sentinel_ids: np.ndarray, eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """(input, target) of ``tokens`` with noise ``mask``: the input with noise span ``k``
    replaced by ``sentinel_ids[k]``, the target as ``sentinel_ids[k]`` + span ``k`` per
    span; each ends with ``eos_id``."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    span_of = np.cumsum(starts) - 1  # at each noise token: its span's index
    sentinel_at = np.where(starts, sentinel_ids[np.maximum(span_of, 0)], tokens)
    inputs = sentinel_at[~mask | starts]
    target_rows = np.flatnonzero(mask)
    before = np.flatnonzero(starts)  # each span's sentinel goes right before its first token
    order = np.argsort(np.concatenate([before, target_rows]), kind="stable")
    pieces = np.concatenate([sentinel_ids[: len(before)], tokens[target_rows]])[order]
    return np.append(inputs, eos_id), np.append(pieces, eos_id)


@dataclass(frozen=True)
class SpanVocab:
    """The ids span corruption needs, from a tokenizer holding ``T5_SPECIAL_TOKENS``."""

    pad_id: int
    eos_id: int
    sentinel_ids: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> SpanVocab:
        ids = np.array([tokenizer.token_id(t) for t in SENTINEL_TOKENS], dtype=np.int64)
        return cls(tokenizer.token_id(PAD_TOKEN), tokenizer.token_id(EOS_TOKEN), ids)


class SpanDataset:
    """The pieces of documents ``doc_ids`` of ``index``: ``[i]`` is piece ``i``'s ids."""

    def __init__(
        self,
        index: IndexedDataset,
        doc_ids: np.ndarray,
        vocab: SpanVocab,
        lengths: SpanLengths,
        name: str = "data",
    ):
        self.index, self.vocab, self.lengths, self.name = index, vocab, lengths, name
        self.doc_ids = np.sort(np.asarray(doc_ids, dtype=np.int64))
        starts, ends = [], []
        raw = lengths.raw_len
        for doc in self.doc_ids.tolist():
            offset, size = int(self.index.offsets[doc]), len(self.index.document(doc)) - 1
            for start in range(0, size, raw):
                if min(size - start, raw) >= 2:
                    starts.append(offset + start)
                    ends.append(offset + min(start + raw, size))
        self.start, self.end = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
        if len(self.start) == 0:
            raise DataError(
                f"{name} has {len(self.doc_ids)} document(s) and no piece of two tokens or "
                f"more to corrupt (add data)"
            )

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.name} ({len(self)} samples)")
        return np.asarray(self.index.tokens[self.start[i] : self.end[i]], dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"SpanDataset({self.name}: {len(self.doc_ids)} docs, {len(self)} pieces of <= "
            f"{self.lengths.raw_len} tokens -> {self.lengths.encoder_len} / "
            f"{self.lengths.decoder_len})"
        )


class SpanBlend(BlendedDataset):
    """Span datasets of several data paths, blended by weight like the GPT ones."""

    def __init__(self, datasets: list[SpanDataset], weights: list[float], name: str):
        super().__init__(datasets, weights, name=name)
        self.vocab, self.lengths = datasets[0].vocab, datasets[0].lengths


class SpanLoader(TokenLoader):
    """Yields one micro-batch dict of tensors, forever: ``tokens`` (the corrupted
    input, ``<pad>``-padded) and ``padding_mask`` ``[b, encoder_len]``;
    ``decoder_tokens`` (the target shifted right after a ``<pad>`` start, as HF's
    ``decoder_start_token_id``), ``labels`` (the target, -100 on padding) and
    ``decoder_padding_mask`` ``[b, decoder_len]``. Sampling, dp striding and the
    resumable state are ``TokenLoader``'s.
    """

    def __init__(
        self,
        dataset: Any,
        *args,
        encoder_len: int,
        decoder_len: int,
        noise_density: float = 0.15,
        mean_span_length: float = 3.0,
        **kwargs,
    ):
        need = dataset.lengths
        if need.encoder_len > encoder_len or need.decoder_len > decoder_len:
            raise DataError(
                f"pieces of {need.raw_len} tokens need {need.encoder_len} encoder and "
                f"{need.decoder_len} decoder positions, more than {encoder_len} / {decoder_len}"
            )
        super().__init__(dataset, *args, **kwargs)
        self.seed = self.sampler.seed
        self.encoder_len, self.decoder_len = encoder_len, decoder_len
        self.noise_density, self.mean_span_length = noise_density, mean_span_length

    def next_draws(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (sample indices, epoch each was drawn in) for the next micro-step."""
        epoch, position = self.sampler.epoch, self.sampler.position
        count = self.micro_batch_size * self.dp_size
        indices = self.sampler.take(count)
        epochs = epoch + (position + np.arange(count)) // self.sampler.num_samples
        return indices[self.dp_rank :: self.dp_size], epochs[self.dp_rank :: self.dp_size]

    def sample(self, index: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(input, target) of sample ``index`` drawn in ``epoch``."""
        tokens = self.dataset[index]
        rng = np.random.default_rng([self.seed, epoch, index, _SPAN_SALT])
        mask = noise_mask(len(tokens), self.noise_density, self.mean_span_length, rng)
        vocab = self.dataset.vocab
        return corrupt(tokens, mask, vocab.sentinel_ids, vocab.eos_id)

    def __next__(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        pad = self.dataset.vocab.pad_id
        b = self.micro_batch_size
        tokens = np.full((b, self.encoder_len), pad, dtype=np.int64)
        decoder = np.full((b, self.decoder_len), pad, dtype=np.int64)
        labels = np.full((b, self.decoder_len), IGNORE_INDEX, dtype=np.int64)
        enc_real = np.zeros((b, self.encoder_len), dtype=bool)
        dec_real = np.zeros((b, self.decoder_len), dtype=bool)
        for row, (index, epoch) in enumerate(zip(*self.next_draws(), strict=True)):
            source, target = self.sample(int(index), int(epoch))
            tokens[row, : len(source)], enc_real[row, : len(source)] = source, True
            labels[row, : len(target)], dec_real[row, : len(target)] = target, True
            decoder[row, 1 : len(target)] = target[:-1]
        arrays = dict(
            tokens=tokens, padding_mask=enc_real, decoder_tokens=decoder, labels=labels,
            decoder_padding_mask=dec_real,
        )  # fmt: skip
        return {key: torch.from_numpy(value) for key, value in arrays.items()}


class SpanData(NamedTuple):
    tokenizer: Tokenizer
    train: SpanDataset | SpanBlend
    valid: SpanDataset | SpanBlend | None  # None when valid_fraction == 0


def build_span_data(
    config: DataConfig,
    encoder_len: int,
    decoder_len: int,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> SpanData:
    """Tokenizer (with ``T5_SPECIAL_TOKENS``) and train/valid span datasets for ``config``;
    the piece length is the longest that fits both lengths (``span_lengths``)."""
    lengths = span_lengths(encoder_len, noise_density, mean_span_length, decoder_len)
    start = time.perf_counter()
    cache_dir = config.resolved_cache_dir()
    sources, all_files = config_sources(config)
    tokenizer = get_tokenizer(
        all_files, cache_dir, config.vocab_size, config.tokenizer, config.text_key,
        special_tokens=T5_SPECIAL_TOKENS,
    )  # fmt: skip
    vocab = SpanVocab.from_tokenizer(tokenizer)

    def samples(index, doc_ids, name):
        return SpanDataset(index, doc_ids, vocab, lengths, name)

    train, valid = train_and_valid(config, sources, tokenizer, cache_dir, samples, SpanBlend)
    log.info(
        "span data ready in %.1f s: %s; train %s; valid %s",
        time.perf_counter() - start, tokenizer, train, valid,
    )  # fmt: skip
    return SpanData(tokenizer, train, valid)
