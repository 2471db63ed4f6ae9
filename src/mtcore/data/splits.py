"""Train and validation datasets of every data path, blended: what the text families'
pipelines share (GPT's and a plugin's through ``build_datasets``, BERT's, T5's).

Each reads the same sources (``data_sources``), indexes each with its tokenizer, splits
it by document (``split_documents``) and blends several paths by ``config.weights``
(default: in proportion to their sizes). Only how a split's documents become samples
differs, packed sequences, sentence pairs or corrupted spans, so each pipeline passes that
in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mtcore.data.cache import DataError
from mtcore.data.config import DataConfig
from mtcore.data.corpus import Source, data_sources
from mtcore.data.indexed import IndexedDataset, get_indexed_dataset, open_token_index
from mtcore.data.samples import split_documents

Sources = list[Source]  # one per data path


def config_sources(config: DataConfig) -> tuple[Sources, list[Path]]:
    """The sources of ``config``, and every text file once, in order: what a trained
    tokenizer learns from.

    A pre-tokenized source (a ``.bin``/``.idx`` pair) needs ``data.tokenizer``: its ids
    mean something only under the tokenizer that wrote them.
    """
    sources = data_sources(config.paths, config.default_corpus_bytes, config.default_corpus_files)
    tokenized = [s for s in sources if s.prefix is not None]
    if tokenized and config.tokenizer is None:
        raise DataError(
            f"data path {tokenized[0].prefix} is already tokenized (.bin/.idx): set "
            "data.tokenizer to the tokenizer.json it was tokenized with"
        )
    return sources, list(dict.fromkeys(f for s in sources for f in s.files))


def train_and_valid(
    config: DataConfig,
    sources: Sources,
    tokenizer: Any,
    cache_dir: Path,
    samples: Callable[[IndexedDataset, np.ndarray, str], Any],
    blend: Callable[..., Any],
) -> tuple[Any, Any | None]:
    """(train, valid) of ``sources``: each source's cached index split by document,
    ``samples(index, doc_ids, name)`` of each side, and with several sources,
    ``blend(datasets, weights, name=...)`` of each side. ``valid`` is None when no
    document is held out."""
    trains, valids = [], []
    for name, files, prefix in sources:
        if prefix is not None:
            index = open_token_index(prefix, tokenizer.vocab_size)
        else:
            index = get_indexed_dataset(
                files, tokenizer, cache_dir, name, config.text_key, config.txt_separator
            )
        train_ids, valid_ids = split_documents(len(index), config.valid_fraction, name)
        trains.append(samples(index, train_ids, f"{name}/train"))
        if len(valid_ids):
            valids.append(samples(index, valid_ids, f"{name}/valid"))
    if len(sources) == 1:
        return trains[0], (valids[0] if valids else None)
    weights = config.weights or [len(t) for t in trains]
    train = blend(trains, weights, name="train")
    valid = blend(valids, weights, name="valid") if valids else None
    return train, valid
