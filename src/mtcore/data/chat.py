"""Conversations for supervised fine-tuning, read and checked: ``data.format: chat``.

A record is one conversation, in one of two forms:

- OpenAI's ``{"messages": [{"role": "system" | "user" | "assistant", "content": str},
  ...]}``, any number of turns;
- ``{"prompt": ..., "completion": ...}``: two strings (one user turn, one assistant
  turn), or two message lists (TRL's conversational prompt-completion form).

Records come from ``.jsonl`` files (one per line), ``.parquet`` files and HF
``datasets`` ``save_to_disk`` directories (one per row; ``mtcore[datasets]``), or
directories of them, in the order ``corpus.find_files`` gives. Anything a chat template
could only render into nonsense is refused here, naming the file and the line or row:
an unknown role, a content that is not a string, a conversation without an assistant
turn, a file without conversations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from mtcore.data.cache import DataError
from mtcore.data.corpus import JSONL_SUFFIXES, TABLE_SUFFIXES, jsonl_records

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]
CHAT_KEYS = ("messages", "prompt", "completion")


def iter_conversations(files: Iterable[Path]) -> Iterator[tuple[str, Messages]]:
    """``(where, messages)`` of each conversation of ``files``, in order, checked; a
    DataError names the first bad record (``where``: ``file:line`` for jsonl,
    ``file: row N`` for tables) and a file with none at all."""
    for path in files:
        found = 0
        for where, record in _records(path):
            yield where, conversation(record, where)
            found += 1
        if not found:
            raise DataError(f"{path}: no conversations in this file (it is empty)")


def conversation(record, where: str) -> Messages:
    """The messages of one record (either form), or a DataError naming ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be an object, got {type(record).__name__}")
    if record.get("messages") is not None:
        messages = record["messages"]
    elif record.get("prompt") is not None or record.get("completion") is not None:
        messages = _prompt_completion(record, where)
    else:
        raise DataError(
            f"{where}: no 'messages' (nor 'prompt'/'completion') in this record "
            f"(keys: {', '.join(map(str, record)) or 'none'})"
        )
    return check_messages(messages, where)


def _prompt_completion(record: dict, where: str) -> list:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):
        return [*prompt, *completion]
    raise DataError(
        f"{where}: 'prompt' and 'completion' must both be strings or both message lists, "
        f"got {type(prompt).__name__} and {type(completion).__name__}"
    )


def check_messages(messages, where: str) -> Messages:
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: message {i} needs a 'role' and a 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise DataError(
                f"{where}: message {i} has the unknown role {role!r} (expected one of "
                f"{', '.join(ROLES)})"
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: message {i} ({role}) has a content that is not a string "
                f"({type(content).__name__})"
            )
        # Only role and content: a parquet row's struct carries every field of the
        # schema (None where a record lacked it), which a template must not see.
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: no assistant turn in this conversation (nothing to train on)")
    return checked


def _records(path: Path) -> Iterator[tuple[str, object]]:
    if path.suffix in JSONL_SUFFIXES:
        yield from _jsonl_records(path)
    elif path.suffix in TABLE_SUFFIXES or path.is_dir():
        from mtcore.data.tables import table_rows  # pyarrow: optional

        for row, record in enumerate(table_rows(path, CHAT_KEYS)):
            yield f"{path}: row {row}", record
    else:
        raise DataError(
            f"{path}: chat data is read from .jsonl, .parquet or a datasets directory, "
            f"not {path.suffix or 'a file without a suffix'}"
        )


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    for lineno, record in jsonl_records(path):
        yield f"{path}:{lineno}", record
