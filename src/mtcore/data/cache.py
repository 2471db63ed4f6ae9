"""Cache keys, atomic writes and build locks shared by the tokenizer and the index.

Every artefact the data pipeline derives (a trained tokenizer, a ``.bin``/``.idx``
pair) is cached on disk under a name that contains a hash of everything it was
derived from. A changed input therefore gets a new name and is rebuilt, and an
unchanged one is reused without re-reading the corpus. Files are written to a
temporary name, fsynced and renamed, so a crash or a concurrent reader never sees
half a file; a per-artefact lock keeps several ranks on one host from building
the same thing at once (the others wait, then reuse it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

try:  # POSIX only; elsewhere the atomic rename alone keeps the cache consistent.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


class DataError(RuntimeError):
    """A problem with the data or its cache; the message names the file or path."""


def fingerprint(files: Sequence[Path], **params: Any) -> str:
    """A short hash of a file list (paths, sizes, mtimes) and build parameters.

    Sizes and mtimes instead of contents: hashing gigabytes on every start would cost
    more than the build we are trying to skip, and an edited file changes its mtime.
    """
    entries = []
    for path in files:
        st = path.stat()
        entries.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"files": entries, "params": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path``; on success fsync it and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` while building ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
