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
from typing import NamedTuple

from mtcore.data.blend import BlendedDataset, blending_indices
from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig, default_cache_dir
from mtcore.data.corpus import DEFAULT_CORPUS_BYTES
from mtcore.data.indexed import IndexedDataset
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
from mtcore.data.samples import SequenceDataset
from mtcore.data.splits import config_sources, train_and_valid
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
    sources, all_files = config_sources(config)
    tok = get_tokenizer(all_files, cache_dir, config.vocab_size, config.tokenizer, config.text_key)

    def samples(index, doc_ids, name):
        return SequenceDataset(index, doc_ids, config.seq_len, name)

    train, valid = train_and_valid(config, sources, tok, cache_dir, samples, BlendedDataset)
    log.info(
        "data ready in %.1f s: %s; train %s; valid %s",
        time.perf_counter() - start,
        tok,
        train,
        valid,
    )
    return Datasets(tok, train, valid)
