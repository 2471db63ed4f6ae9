"""The data section of a training config, validated before any process group starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from mtcore.data.corpus import DEFAULT_CORPUS_BYTES


def default_cache_dir() -> Path:
    """``$MTCORE_DATA_CACHE``, else ``~/.cache/mtcore/data``: shared by all jobs of a user, so
    the tokenizer and index built by the first job are reused by every later one."""
    env = os.environ.get("MTCORE_DATA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtcore" / "data"


class DataConfig(BaseModel, extra="forbid"):
    """What to train on and how to cut it into samples.

    ``paths=None`` trains on the embedded default corpus (the Python standard
    library's source). Each entry of ``paths`` is one dataset: a file or a directory
    of ``.py``/``.txt``/``.md``/``.jsonl``/``.parquet`` files, a HF ``datasets``
    ``save_to_disk`` directory, or the prefix of a ``.bin``/``.idx`` pair (written by
    ``mtcore data prepare`` or by Megatron-LM). Several are blended by ``weights``
    (default: in proportion to their sizes); Megatron's ``--data-path w1 p1 w2 p2``
    form, weights and paths alternating in ``paths``, means the same.
    """

    paths: list[str] | None = None
    weights: list[float] | None = None
    text_key: str = Field(
        "text", min_length=1, description="JSONL/parquet/datasets field that holds a document"
    )
    txt_separator: str | None = Field(
        "",
        description='.txt documents: "" split at blank lines, a string split at it, '
        "None one document per file",
    )
    tokenizer: str | None = Field(
        None, description="a tokenizer.json; None trains a BPE on the data"
    )
    vocab_size: int = Field(8192, ge=257, le=2**31 - 1, description="for a trained tokenizer")
    seq_len: int = Field(256, ge=1)
    valid_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of documents held out")
    cache_dir: str | None = Field(
        None, description="None: $MTCORE_DATA_CACHE or ~/.cache/mtcore/data"
    )
    seed: int = Field(1234, ge=0, description="sample order; the split does not depend on it")
    default_corpus_bytes: int | None = Field(DEFAULT_CORPUS_BYTES, ge=1)
    default_corpus_files: int | None = Field(None, ge=1)
    format: Literal["text", "chat"] = Field(
        "text",
        description="text: documents packed into sequences; chat: conversations (messages, "
        "or prompt/completion) rendered by the tokenizer's chat template, loss on the answers",
    )
    document_masks: bool = Field(
        False,
        description="text: each token attends only its own document (split at <|endoftext|>); "
        "the batch carries 'documents'",
    )
    reset_position_ids: bool = Field(
        False, description="position ids restart at every document (the batch carries 'positions')"
    )
    chat_loss: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant", description="chat: train on every assistant turn, or on the last only"
    )
    packing: bool = Field(
        True,
        description="chat: pack conversations into seq_len samples with document masks; "
        "false: one conversation per sample, padded",
    )
    overlong: Literal["truncate", "refuse"] = Field(
        "truncate", description="chat: a conversation longer than seq_len is cut, or refused"
    )
    chat_template: str | None = Field(
        None,
        description="chat: a Jinja chat template (or a file holding one) for a tokenizer "
        "without its own",
    )

    @model_validator(mode="before")
    @classmethod
    def _megatron_blend(cls, values):
        """``paths: [0.3, a, 0.7, b]`` (Megatron's ``--data-path``) -> paths + weights."""
        if not isinstance(values, dict):
            return values
        paths = values.get("paths")
        if not isinstance(paths, list) or len(paths) < 2 or not _is_weight(paths[0]):
            return values
        if len(paths) % 2 or not all(_is_weight(w) for w in paths[::2]):
            raise ValueError(
                "paths mixes weights and paths: give [w1, path1, w2, path2, ...] "
                f"(Megatron's --data-path form) or paths alone, got {paths}"
            )
        if values.get("weights") is not None:
            raise ValueError("paths already holds weights (w1, path1, ...): drop data.weights")
        return {**values, "paths": [str(p) for p in paths[1::2]],
                "weights": [float(w) for w in paths[::2]]}  # fmt: skip

    @model_validator(mode="after")
    def _check_paths_and_weights(self) -> DataConfig:
        if self.paths is not None and not self.paths:
            raise ValueError(
                "paths is an empty list: give data paths, or None for the default corpus"
            )
        if self.weights is not None:
            n_paths = len(self.paths) if self.paths else 1
            if len(self.weights) != n_paths:
                raise ValueError(
                    f"{len(self.weights)} weights for {n_paths} data path(s): give one per path"
                )
            if any(not w > 0 for w in self.weights):
                raise ValueError(f"weights must be positive, got {self.weights}")
        return self

    @model_validator(mode="after")
    def _check_format_options(self) -> DataConfig:
        # A value other than the default, not a key that is set: a dumped config (a
        # checkpoint's config.yaml, the planner's re-check) holds every key.
        fields = type(self).model_fields
        changed = [k for k in ("chat_loss", "packing", "overlong", "chat_template")
                   if getattr(self, k) != fields[k].default]  # fmt: skip
        if self.format == "text" and changed:
            raise ValueError(f"data.{changed[0]} applies to data.format chat only")
        if self.format == "chat" and self.weights is not None:
            raise ValueError(
                "data.weights blends text datasets; chat data reads every path once (drop it)"
            )
        if self.reset_position_ids and not self.documents_in_batch:
            needs = "data.document_masks true" if self.format == "text" else "data.packing true"
            raise ValueError(f"data.reset_position_ids needs documents in the batch: set {needs}")
        return self

    @property
    def documents_in_batch(self) -> bool:
        """Whether batches carry ``documents``: text with ``document_masks``; chat packed
        (several conversations in a sample must not see each other) or asked for."""
        if self.format == "chat":
            return self.packing or self.document_masks
        return self.document_masks

    def check_plain_text(self, family: str) -> None:
        """For a family whose batches carry no documents nor chat samples (BERT, T5,
        LLaVA): refuse the options it would silently ignore, in one line."""
        from mtcore.data.cache import DataError

        for name, on in (("format chat", self.format == "chat"),
                         ("document_masks", self.document_masks)):  # fmt: skip
            if on:
                raise DataError(
                    f"data.{name}: the {family} family reads plain text; chat data and "
                    "document masks are for the gpt family"
                )

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


def _is_weight(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not Path(str(value)).exists()  # a file called "1" stays a path
