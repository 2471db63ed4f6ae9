"""Documents from columnar files: parquet, and HuggingFace ``datasets`` directories.

Both are Arrow tables underneath: a ``.parquet`` file, or the ``.arrow`` stream files
that ``datasets.Dataset.save_to_disk`` writes next to its ``state.json`` (which lists
them in order). Each row's ``text_key`` column is one document. They are read with
``pyarrow`` in record batches, so a file larger than memory streams through; pyarrow
comes with the optional extra ``mtcore[datasets]`` and is imported only when such a
file is read, so a job on text files never needs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mtcore.data.cache import DataError

EXTRA_HINT = "install the optional extra: pip install 'mtcore[datasets]'"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"reading parquet or datasets directories needs pyarrow: {EXTRA_HINT}"
        ) from None
    return pyarrow


def _record_batches(pa, path: Path, columns: tuple[str, ...]):
    """Record batches of a ``save_to_disk`` directory, or of a parquet file reading only
    those of ``columns`` it has (all of them when it has none: the caller names what is
    missing)."""
    if path.is_dir():
        return _arrow_dir_batches(pa, path)
    try:
        table = pa.parquet.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    present = [c for c in columns if c in table.schema_arrow.names]
    return table.iter_batches(batch_size=1024, columns=present or None)


def table_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """The non-empty ``text_key`` values of a parquet file or a ``save_to_disk`` directory."""
    pa = _pyarrow()
    # Only the text column is read: the others (ids, metadata) can be most of the file.
    for batch in _record_batches(pa, path, (text_key,)):
        if text_key not in batch.schema.names:
            raise DataError(
                f"{path}: no column {text_key!r} (columns: {', '.join(batch.schema.names)}); "
                "set data.text_key"
            )
        column = batch.column(text_key)
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            raise DataError(f"{path}: column {text_key!r} holds {column.type}, not strings")
        for text in column.to_pylist():
            if text:
                yield text


def table_rows(path: Path, keys: tuple[str, ...]) -> Iterator[dict]:
    """Each row of a parquet file or a ``save_to_disk`` directory as a dict of those of
    ``keys`` it has (a chat record: ``messages``, or ``prompt``/``completion``)."""
    pa = _pyarrow()
    for batch in _record_batches(pa, path, keys):
        present = [k for k in keys if k in batch.schema.names]
        if not present:
            raise DataError(
                f"{path}: none of the columns {', '.join(keys)} (columns: "
                f"{', '.join(batch.schema.names)})"
            )
        yield from batch.select(present).to_pylist()


def _arrow_dir_batches(pa, path: Path) -> Iterator:
    state_path = path / "state.json"
    try:
        files = [entry["filename"] for entry in json.loads(state_path.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state_path}: not a datasets save_to_disk state file ({e})") from None
    for name in files:
        arrow = path / name
        if not arrow.is_file():
            raise DataError(f"{path}: its state.json lists {name}, which does not exist")
        with pa.memory_map(str(arrow)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                continue
            yield from reader
