"""Rendered conversations on disk: tokens and loss mask written once, mapped by every run.

``prepare_chat`` renders every conversation of the inputs (``chat_render``) into

    <prefix>.bin / .idx   the token ids, one document per conversation (the text
                          path's format: ``IndexedDataset`` reads it)
    <prefix>.mask         one uint8 per token: 0 not trained, 1 an assistant turn,
                          2 the last assistant turn
    <prefix>.json         what was prepared: the inputs' key, the renderer's
                          fingerprint (tokenizer + chat template), the counts

so a large SFT set is tokenized by ``mtcore data prepare --format chat`` once, or by
the first training run into the data cache, and never again. A run reading it with
another tokenizer or template is refused: its ids or its masks would mean something
else. Rendering runs in one process: a Jinja template is Python, and a chat set is
small beside a pretraining corpus.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mtcore.data.cache import DataError, atomic_write, build_lock, fingerprint
from mtcore.data.chat import iter_conversations
from mtcore.data.chat_render import ChatRenderer
from mtcore.data.indexed import IndexedDataset, check_ids, token_dtype, write_index
from mtcore.data.progress import Progress, say

VERSION = 1


class ChatIndex(NamedTuple):
    """A prepared chat set: its tokens (one document per conversation) and their mask."""

    tokens: IndexedDataset
    mask: np.ndarray  # uint8, one per token of ``tokens``
    record: dict  # the manifest


class ChatPrepared(NamedTuple):
    prefix: Path
    conversations: int
    tokens: int
    trained_tokens: int  # mask != 0 (every assistant turn)
    seconds: float
    up_to_date: bool


def _with(prefix: Path, suffix: str) -> Path:
    return prefix.with_name(prefix.name + suffix)


def chat_key(files: Sequence[Path], renderer: ChatRenderer) -> str:
    return fingerprint(files, renderer=renderer.fingerprint, format="chat", version=VERSION)


def prepare_chat(files: Sequence[Path], renderer: ChatRenderer, output: str | Path) -> ChatPrepared:
    """Render ``files`` into ``<output>.bin/.idx/.mask/.json`` (nothing to do when they
    already hold these inputs under this renderer)."""
    prefix = Path(output).expanduser()
    if prefix.suffix in (".bin", ".idx", ".mask"):
        prefix = prefix.with_suffix("")
    key = chat_key(files, renderer)
    progress = Progress(f"prepare {prefix.name}", sum(f.stat().st_size for f in files))
    with build_lock(_with(prefix, ".idx")):
        record = _up_to_date(prefix, key)
        if record is not None:
            say(f"{prefix}: already prepared from these inputs and template; nothing to do")
            return ChatPrepared(prefix, record["conversations"], record["tokens"],
                                record["trained_tokens"], 0.0, True)  # fmt: skip
        lengths, max_id, trained = [], 0, 0
        vocab = renderer.tokenizer.vocab_size
        dtype = token_dtype(vocab)
        with (
            atomic_write(_with(prefix, ".bin")) as bin_file,
            atomic_write(_with(prefix, ".mask")) as mask_file,
        ):
            for n, (where, messages) in enumerate(iter_conversations(files)):
                if n == 0:
                    renderer.check_configured(messages, where)
                ids, mask = renderer.render(messages, where)
                check_ids(ids, vocab, Path(where))
                bin_file.write(ids.astype(dtype).tobytes())
                mask_file.write(mask.tobytes())
                lengths.append(len(ids))
                max_id, trained = (
                    max(max_id, int(ids.max(initial=0))),
                    trained + int(np.count_nonzero(mask)),
                )
                progress.update(1, len(ids))
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        _with(prefix, ".idx").unlink(missing_ok=True)  # never a stale index with new tokens
        write_index(_with(prefix, ".idx"), offsets, dtype, vocab_size=vocab, max_id=max_id)
        record = {
            "key": key, "format": "chat", "renderer": renderer.fingerprint,
            "conversations": len(lengths), "tokens": int(offsets[-1]),
            "trained_tokens": trained, "inputs": [str(f) for f in files],
        }  # fmt: skip
        with atomic_write(_with(prefix, ".json"), "w") as f:
            json.dump(record, f, indent=1)
    progress.close()
    return ChatPrepared(prefix, len(lengths), int(offsets[-1]), trained, progress.seconds, False)


def _up_to_date(prefix: Path, key: str) -> dict | None:
    try:
        record = json.loads(_with(prefix, ".json").read_text())
        index = open_chat_index(prefix)
    except (OSError, ValueError, DataError):
        return None
    if record.get("key") != key or len(index.tokens) != record.get("conversations"):
        return None
    return record


def open_chat_index(prefix: str | Path, renderer: ChatRenderer | None = None) -> ChatIndex:
    """The prepared set at ``prefix``; with ``renderer``, refused unless it was rendered
    by the same tokenizer and chat template."""
    prefix = Path(prefix).expanduser()
    try:
        record = json.loads(_with(prefix, ".json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"{prefix}: not a prepared chat set (no readable {_with(prefix, '.json').name}: "
            f"{e}); write one with mtcore data prepare --format chat"
        ) from None
    if not isinstance(record, dict) or record.get("format") != "chat":
        raise DataError(f"{prefix}: prepared as text, not chat; use it with data.format text")
    if renderer is not None and record.get("renderer") != renderer.fingerprint:
        raise DataError(
            f"{prefix}: prepared with another tokenizer or chat template than this job's; "
            "prepare it again with data.tokenizer (and data.chat_template)"
        )
    tokens = IndexedDataset(prefix, renderer.tokenizer.vocab_size if renderer else None)
    mask_path = _with(prefix, ".mask")
    if not mask_path.is_file() or mask_path.stat().st_size != tokens.num_tokens:
        raise DataError(
            f"{mask_path}: missing or not one byte per token ({tokens.num_tokens} tokens); "
            "prepare the set again"
        )
    return ChatIndex(tokens, np.memmap(mask_path, dtype=np.uint8, mode="r"), record)
