"""`mtcore data prepare` without ``--tokenizer``: the tokenizer `mtcore train` would use
for the config (``--config``; none: the built-in defaults), so a new user needs no
``tokenizer.json`` of their own.

That is ``data.tokenizer`` when the config names one, else the byte-level BPE that
`mtcore train CONFIG` trains on the config's corpus at first use (cached, so training
reuses the same file). A copy is written beside the output (``PREFIX.tokenizer.json``)
once the data is prepared: tokens mean something only with the tokenizer that wrote
them, and training on a ``.bin``/``.idx`` needs ``--data.tokenizer``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple


class ChosenTokenizer(NamedTuple):
    path: Path  # what the data is tokenized with
    source: str  # where it came from, in words


def config_tokenizer(config_path: str | None) -> ChosenTokenizer:
    """The tokenizer `mtcore train` uses for ``config_path`` (ConfigError, DataError)."""
    from mtcore.data import DataError
    from mtcore.data.splits import config_sources
    from mtcore.data.tokenizer import get_tokenizer
    from mtcore.training.overrides import load_config

    config = load_config(config_path)
    where = config_path or "the built-in defaults"
    data = config.data
    if data.tokenizer is not None:
        return ChosenTokenizer(Path(data.tokenizer).expanduser(), f"{where}'s data.tokenizer")
    family = config.model.family
    if family != "gpt":  # encoders train theirs with their own special tokens
        raise DataError(
            f"the {family} family of {where} trains its tokenizer with its own special "
            "tokens: pass --tokenizer FILE"
        )
    _, files = config_sources(data)
    trained = get_tokenizer(files, data.resolved_cache_dir(), data.vocab_size, None, data.text_key)
    corpus = "its corpus" if data.paths else "the embedded corpus (the standard library)"
    return ChosenTokenizer(
        trained.path,
        f"the {trained.vocab_size}-token BPE `mtcore train` trains for {where} on {corpus} "
        f"(cached at {trained.path})",
    )


def write_beside(chosen: ChosenTokenizer, prefix: Path) -> Path:
    """A copy of the tokenizer at ``PREFIX.tokenizer.json`` (OSError if it cannot be written)."""
    from mtcore.data.cache import atomic_write

    target = prefix.with_name(f"{prefix.name}.tokenizer.json")
    if target.resolve() != chosen.path.resolve():
        with atomic_write(target) as out, open(chosen.path, "rb") as source:
            shutil.copyfileobj(source, out)
    return target
