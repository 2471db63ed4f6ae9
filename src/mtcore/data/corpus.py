"""Where documents come from: user files and directories, or the embedded default corpus.

A *document* is the unit the index records and the train/validation split works
on: one whole ``.py``/``.md`` file, one blank-line-separated piece of a ``.txt``
file (``data.txt_separator``), one line of a ``.jsonl`` file or one row of a
``.parquet`` file or a HF ``datasets`` ``save_to_disk`` directory (its text field). Files are visited in sorted order so that the same inputs always give
the same token stream, on every rank and every machine.

The default corpus is the Python standard library's own source, found from the
running interpreter. Every Python install carries it, so the default training job
needs no download (none is possible on air-gapped clusters) and no data licence
beyond the PSF's. It is capped by bytes so tokenizer training plus the index build
stays well under a minute on a two-core machine.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from mtcore.data.cache import DataError

TEXT_SUFFIXES = (".py", ".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
TABLE_SUFFIXES = (".parquet",)  # and HF datasets save_to_disk directories (mtcore[datasets])
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES

# 8 MB of stdlib source is ~2.1M tokens with an 8k vocab: plenty for the toy-sized
# default job, and the tokenizer + index build takes ~15 s on two cores.
DEFAULT_CORPUS_BYTES = 8_000_000
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}


def find_files(path: str | Path) -> list[Path]:
    """The corpus files of one data path: the file itself, or the matching files under it."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data path does not exist: {root}")
    if root.is_dir() and is_hf_dataset_dir(root):
        return [root]
    if root.is_file():
        if root.suffix not in SUFFIXES:
            raise DataError(f"unsupported data file {root}: expected one of {', '.join(SUFFIXES)}")
        files = [root]
    else:
        files = sorted(
            (p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise DataError(f"no {'/'.join(SUFFIXES)} files under data path {root}")
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"data path {root} is empty: its {len(files)} file(s) hold no text")
    return files


def is_hf_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory ``datasets.Dataset.save_to_disk`` wrote."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def stdlib_files(
    max_bytes: int | None = DEFAULT_CORPUS_BYTES, max_files: int | None = None
) -> list[Path]:
    """The standard library's ``*.py`` files in sorted order, without tests and site-packages.

    The cap keeps a prefix of the sorted list (whole files), so it is deterministic
    for a given Python install.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the interpreter's standard library was not found at {root}")
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages can hold far more files than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        candidates += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    files, total = [], 0
    for p in candidates:
        if max_files is not None and len(files) >= max_files:
            break
        if max_bytes is not None and total >= max_bytes:
            break
        size = p.stat().st_size
        if size:
            files.append(p)
            total += size
    if not files:
        raise DataError(f"no standard-library sources found under {root}")
    return files


class Source(NamedTuple):
    """One dataset of a job: text files to tokenize, or a token index read as it is."""

    name: str
    files: list[Path]  # the text files ([] for a pre-tokenized source)
    prefix: Path | None = None  # a .bin/.idx pair (mtcore's or Megatron's MMIDIDX)


def pretokenized_prefix(path: str | Path) -> Path | None:
    """The ``.bin``/``.idx`` prefix ``path`` names (``data/x``, ``data/x.idx`` or
    ``data/x.bin`` for the pair ``data/x.bin`` + ``data/x.idx``), else None."""
    path = Path(path).expanduser()
    if path.suffix in (".bin", ".idx") and not path.is_dir():
        prefix = path.with_suffix("")
    elif path.with_name(path.name + ".idx").is_file():
        prefix = path
    else:
        return None
    idx, bin_ = (prefix.with_name(prefix.name + s) for s in (".idx", ".bin"))
    if not idx.is_file() or not bin_.is_file():
        missing = bin_ if idx.is_file() else idx
        raise DataError(f"data path {path} names a token index, but {missing} does not exist")
    return prefix


def data_sources(
    paths: Sequence[str] | None,
    default_corpus_bytes: int | None = DEFAULT_CORPUS_BYTES,
    default_corpus_files: int | None = None,
) -> list[Source]:
    """One source per data path, or the default corpus for ``None``.

    Shared by the text families' pipelines (GPT, BERT, T5, a plugin's through
    ``build_datasets``), so all of them read the same documents.
    """
    if paths is None:
        return [Source("stdlib", stdlib_files(default_corpus_bytes, default_corpus_files))]
    sources = []
    for p in paths:
        prefix = pretokenized_prefix(p)
        if prefix is not None:
            sources.append(Source(prefix.name, [], prefix))
        else:
            sources.append(Source(Path(p).expanduser().stem or "data", find_files(p)))
    return sources


_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def split_text(text: str, separator: str | None = "") -> list[str]:
    """The documents of one ``.txt`` file: split at blank lines (``separator=""``), at
    ``separator`` itself, or the whole file (``None``); empty pieces dropped.

    One corpus file of many documents is the common shape of a plain-text corpus, and
    treating it as one document would put all of it on one side of the split."""
    if separator is None:
        pieces = [text]
    elif separator == "":
        pieces = _BLANK_LINES.split(text)
    else:
        pieces = text.split(separator)
    return [p for p in pieces if p.strip()]


def iter_documents(
    files: Iterable[Path], text_key: str = "text", txt_separator: str | None = ""
) -> Iterator[str]:
    """Yield the non-empty documents of ``files`` in order: a ``.py``/``.md`` file whole,
    a ``.txt`` file cut by ``split_text(text, txt_separator)``, a ``.jsonl`` line's
    ``text_key``, a parquet row's or a ``datasets`` directory's record's ``text_key``."""
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_key)
        elif path.suffix in TABLE_SUFFIXES or path.is_dir():
            from mtcore.data.tables import table_documents  # pyarrow/datasets: optional

            yield from table_documents(path, text_key)
        else:
            text = _utf8(read_bytes(path), path)
            if path.suffix == ".txt":
                yield from split_text(text, txt_separator)
            elif text:
                yield text


def read_bytes(path: Path) -> bytes:
    """``path``'s bytes, or a DataError naming it (unreadable: permissions, a directory,
    an I/O error)."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def read_utf8(path: Path) -> str:
    """``path``'s text, or a DataError naming the file (and, for bytes that are not UTF-8,
    the line, column and byte)."""
    return _utf8(read_bytes(path), path)


def _utf8(data: bytes, path: Path, first_line: int = 1) -> str:
    """``data`` decoded, or a DataError naming the file, the line and the byte: a corpus is
    UTF-8, and text replaced by U+FFFD would train silently on garbage."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data[: e.start].count(b"\n")
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at column {column}); "
            "convert the file, e.g. iconv -f latin1 -t utf-8"
        ) from None


def jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of ``path``, or a DataError
    naming the file and line (unreadable, not UTF-8, not JSON)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; an open failure is named)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    for lineno, record in jsonl_records(path):
        if not isinstance(record, dict) or text_key not in record:
            raise DataError(f"{path}:{lineno}: no {text_key!r} field in this record")
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: field {text_key!r} is not a string")
        if text:
            yield text


def batched_documents(
    docs: Iterable[str], max_bytes: int = 4_000_000, max_docs: int = 4096
) -> Iterator[list[str]]:
    """Group documents into batches for ``encode_batch``: big enough to keep all cores
    busy, small enough that a huge corpus never has to fit in memory at once."""
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= max_bytes or len(batch) >= max_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
