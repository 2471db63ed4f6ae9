"""Training data: tokenizer, memory-mapped token index, packed samples, blending, loader.

The trainer needs two calls::

    tok, train, valid = build_datasets(DataConfig(seq_len=model.seq_len))
    loader = TokenLoader(train, micro_batch_size=4, global_batch_size=32,
                         dp_rank=dp_rank, dp_size=dp_size, seed=config.seed)
    tokens, targets = next(loader)          # int64 [micro_batch_size, seq_len] each
    state = loader.state_dict()             # into the checkpoint; load_state_dict() to resume

BERT jobs use ``build_pair_data`` and ``PairLoader`` instead (see ``pairs.py``).

Everything expensive (tokenizer training, tokenization) happens once and is
cached on disk, keyed by its inputs; later starts only map files. Size the model's
embedding from ``tok.vocab_size``: a trained BPE can come out smaller than asked.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NamedTuple

from mtcore.data.blend import BlendedDataset, blending_indices
from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig, default_cache_dir
from mtcore.data.corpus import DEFAULT_CORPUS_BYTES, data_sources
from mtcore.data.indexed import IndexedDataset, get_indexed_dataset
from mtcore.data.loader import EpochSampler, TokenLoader, check_batch_sizes
from mtcore.data.pair_loader import PairLoader, mask_sequence
from mtcore.data.pairs import (
    BERT_SPECIAL_TOKENS,
    PAIR_TASKS,
    PairBlend,
    PairData,
    PairDataset,
    PairSample,
    PairVocab,
    build_pair_data,
)
from mtcore.data.samples import SequenceDataset, split_documents
from mtcore.data.tokenizer import EOD_TOKEN, Tokenizer, get_tokenizer, load_tokenizer

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "DEFAULT_CORPUS_BYTES",
    "EOD_TOKEN",
    "PAIR_TASKS",
    "BlendedDataset",
    "DataConfig",
    "DataError",
    "Datasets",
    "EpochSampler",
    "IndexedDataset",
    "PairBlend",
    "PairData",
    "PairDataset",
    "PairLoader",
    "PairSample",
    "PairVocab",
    "SequenceDataset",
    "TokenLoader",
    "Tokenizer",
    "blending_indices",
    "build_datasets",
    "build_pair_data",
    "check_batch_sizes",
    "default_cache_dir",
    "load_tokenizer",
    "mask_sequence",
]

log = logging.getLogger(__name__)


class Datasets(NamedTuple):
    tokenizer: Tokenizer
    train: SequenceDataset | BlendedDataset
    valid: SequenceDataset | BlendedDataset | None  # None when valid_fraction == 0


def build_datasets(config: DataConfig | None = None, **overrides) -> Datasets:
    """Tokenizer and train/validation datasets for ``config`` (fields may be given as keywords).

    Safe to call on every rank at once: the first process on a host builds each
    cached file under a lock, the others wait and then map it.
    """
    if config is None or overrides:
        config = DataConfig.model_validate({**(config.model_dump() if config else {}), **overrides})
    cache_dir = config.resolved_cache_dir()
    start = time.perf_counter()
    sources = _sources(config)
    all_files = list(dict.fromkeys(f for _, files in sources for f in files))
    tok = get_tokenizer(all_files, cache_dir, config.vocab_size, config.tokenizer, config.text_key)
    trains, valids = [], []
    for name, files in sources:
        index = get_indexed_dataset(files, tok, cache_dir, name, config.text_key)
        train_ids, valid_ids = split_documents(len(index), config.valid_fraction, name)
        trains.append(SequenceDataset(index, train_ids, config.seq_len, f"{name}/train"))
        if len(valid_ids):
            valids.append(SequenceDataset(index, valid_ids, config.seq_len, f"{name}/valid"))
    if len(sources) == 1:
        train, valid = trains[0], (valids[0] if valids else None)
    else:
        weights = config.weights or [len(t) for t in trains]
        train = BlendedDataset(trains, weights, name="train")
        valid = BlendedDataset(valids, weights, name="valid") if valids else None
    log.info(
        "data ready in %.1f s: %s; train %s; valid %s",
        time.perf_counter() - start,
        tok,
        train,
        valid,
    )
    return Datasets(tok, train, valid)


def _sources(config: DataConfig) -> list[tuple[str, list[Path]]]:
    return data_sources(config.paths, config.default_corpus_bytes, config.default_corpus_files)
