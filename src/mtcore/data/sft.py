"""``data.format: chat``: the tokenizer, the train and validation samples, and their loader.

Each data path is a chat file or directory (``chat``), or a set ``mtcore data prepare
--format chat`` wrote (its ``PREFIX``); with no paths, the embedded chat set
(``chat_corpus``). Files are rendered once into the data cache, keyed by the inputs,
the tokenizer and the template (``chat_prepare``); the split holds out whole
conversations (``valid_fraction``), as the text path holds out documents.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mtcore.data.cache import DataError
from mtcore.data.chat import iter_conversations
from mtcore.data.chat_corpus import default_chat_files, train_chat_tokenizer
from mtcore.data.chat_prepare import chat_key, open_chat_index, prepare_chat
from mtcore.data.chat_render import ChatRenderer
from mtcore.data.chat_samples import ChatSamples
from mtcore.data.config import DataConfig
from mtcore.data.corpus import find_files, pretokenized_prefix
from mtcore.data.loader import SampleLoader
from mtcore.data.samples import split_documents

log = logging.getLogger(__name__)


def _prepared_prefix(path: str) -> Path | None:
    """``path`` as the prefix of a prepared chat set (``PREFIX`` or ``PREFIX.idx``)."""
    prefix = Path(path).expanduser()
    if prefix.suffix in (".idx", ".bin", ".mask") and not prefix.is_dir():
        prefix = prefix.with_suffix("")
    return prefix if prefix.with_name(prefix.name + ".mask").is_file() else None


def conversation_texts(files: Sequence[Path]) -> Iterator[str]:
    """The conversations' messages as text: what a tokenizer for them is trained on."""
    for _where, messages in iter_conversations(files):
        for message in messages:
            yield f"{message['role']}\n{message['content']}"


def chat_renderer(config: DataConfig, files: Sequence[Path]) -> ChatRenderer:
    """``data.tokenizer`` with its template, or a BPE trained on ``files`` with ChatML."""
    tokenizer = config.tokenizer
    if tokenizer is None:
        if not files:
            raise DataError(
                "data paths are prepared chat sets: set data.tokenizer to the tokenizer "
                "they were prepared with"
            )
        tokenizer = train_chat_tokenizer(
            files, config.resolved_cache_dir(), config.vocab_size, conversation_texts
        )
    return ChatRenderer(tokenizer, config.chat_template)


def build_chat_datasets(config: DataConfig):
    """``Datasets(tokenizer, train, valid)`` of chat ``config`` (``mtcore.data.Datasets``)."""
    from mtcore.data import Datasets

    start = time.perf_counter()
    cache = config.resolved_cache_dir()
    sources: list[tuple[str, Path | None, list[Path]]] = []  # name, prepared prefix, files
    if config.paths is None:
        sources.append(("chat-set", None, default_chat_files(cache)))
    else:
        for path in config.paths:
            prefix = _prepared_prefix(path)
            if prefix is None and pretokenized_prefix(path) is not None:
                raise DataError(
                    f"data path {path} holds text tokens (.bin/.idx, no .mask): prepare chat "
                    "data with mtcore data prepare --format chat, or set data.format text"
                )
            files = [] if prefix is not None else find_files(path)
            sources.append((Path(path).expanduser().stem or "chat", prefix, files))
    renderer = chat_renderer(config, [f for _, _, files in sources for f in files])
    trains, valids = [], []
    for name, prefix, files in sources:
        if prefix is None:
            prefix = cache / f"chat-{name}-{chat_key(files, renderer)}"
            prepare_chat(files, renderer, prefix)
        index = open_chat_index(prefix, renderer)
        train_ids, valid_ids = split_documents(len(index.tokens), config.valid_fraction, name)
        trains.append((index, train_ids))
        if len(valid_ids):
            valids.append((index, valid_ids))
    samples = functools.partial(
        ChatSamples,
        seq_len=config.seq_len,
        pad_id=renderer.tokenizer.eod_id,
        packing=config.packing,
        overlong=config.overlong,
        chat_loss=config.chat_loss,
        documents=config.documents_in_batch,
    )
    train = samples(trains, name="train")
    valid = samples(valids, name="valid") if valids else None
    log.info("chat data ready in %.1f s: train %s; valid %s", time.perf_counter() - start,
             train, valid)  # fmt: skip
    return Datasets(renderer.tokenizer, train, valid)


def chat_loader(config: DataConfig):
    """The loader factory ``FamilyData`` takes: ``SampleLoader`` over ``ChatSamples``."""
    return functools.partial(SampleLoader, reset_position_ids=config.reset_position_ids)
