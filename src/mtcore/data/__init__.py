"""Training data that every family shares: tokenizer, memory-mapped token index, packed
samples, blending, samplers, loaders, and ``mtcore data prepare``.

A next-token language model needs two calls::

    tok, train, valid = build_datasets(DataConfig(seq_len=model.seq_len))
    loader = LMLoader(train, micro_batch_size=4, global_batch_size=32,
                      dp_rank=dp_rank, dp_size=dp_size, seed=config.seed)
    batch = next(loader)                    # {"tokens", "labels"}: int64 [micro_batch, seq_len]
    state = loader.state_dict()             # into the checkpoint; load_state_dict() to resume

What one family alone reads lives in its folder (``models/<family>/data.py``: BERT's
sentence pairs, T5's span corruption, LLaVA's images and records), built from these.

Everything expensive (tokenizer training, tokenization) happens once and is
cached on disk, keyed by its inputs; later starts only map files. Size the model's
embedding from ``tok.vocab_size``: a trained BPE can come out smaller than asked.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from mtcore import lazy_exports
from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig, default_cache_dir
from mtcore.data.corpus import DEFAULT_CORPUS_BYTES

if TYPE_CHECKING:
    from mtcore.data.blend import BlendedDataset
    from mtcore.data.samples import SequenceDataset
    from mtcore.data.tokenizer import Tokenizer

# The settings above load with the package (a config is read, e.g. by ``mtcore plan``,
# without numpy, tokenizers or torch); what reads and serves the data on first use.
_ON_USE = {
    "BlendedDataset": ".blend",
    "blending_indices": ".blend",
    "IndexedDataset": ".indexed",
    "EpochSampler": ".loader",
    "LMLoader": ".loader",
    "TokenLoader": ".loader",
    "check_batch_sizes": ".loader",
    "lm_batches": ".loader",
    "SequenceDataset": ".samples",
    "EOD_TOKEN": ".tokenizer",
    "Tokenizer": ".tokenizer",
    "load_tokenizer": ".tokenizer",
}


__getattr__ = lazy_exports(__name__, _ON_USE)


__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "EOD_TOKEN",
    "BlendedDataset",
    "DataConfig",
    "DataError",
    "Datasets",
    "EpochSampler",
    "IndexedDataset",
    "LMLoader",
    "SequenceDataset",
    "TokenLoader",
    "Tokenizer",
    "blending_indices",
    "build_datasets",
    "check_batch_sizes",
    "default_cache_dir",
    "lm_batches",
    "load_tokenizer",
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
    if config.format == "chat":
        raise DataError("build_datasets reads text; data.format chat: mtcore.data.sft")
    from mtcore.data.blend import BlendedDataset
    from mtcore.data.samples import SequenceDataset
    from mtcore.data.splits import config_sources, train_and_valid
    from mtcore.data.tokenizer import get_tokenizer

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
