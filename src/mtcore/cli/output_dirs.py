"""Outputs of `mtcore convert` that a failure (a full disk, a write error, bad input found
late) leaves as they were: nothing half-written, so "nothing was written" stays true.

* ``staged(out)``: the whole output is written into a hidden sibling of ``out`` and
  renamed to ``out`` at the end (a Megatron checkpoint root, which has no commit of its
  own: a reader would take a half-written ``iter_N`` as it found it);
* ``undone_on_failure(out)``: for a root that mtcore's own commit protocol writes into
  (``step_N.partial`` renamed to ``step_N``), what the command added under ``out`` (the
  staging directory, ``out`` itself and the parents it created) is removed if it fails.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` (itself included) that does not exist yet."""
    missing = None
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing = directory
    return missing


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def undone_on_failure(out: str | Path) -> Iterator[Path]:
    """Run the block; if it raises, remove what it added at ``out``: every entry of ``out``
    that was not there before (or ``out`` and the parents it had to create)."""
    out = Path(out).expanduser()
    created = _first_missing(out)
    before = set(os.listdir(out)) if created is None and out.is_dir() else set()
    try:
        yield out
    except BaseException:
        if created is not None:
            _remove(created)
        elif out.is_dir():
            for name in set(os.listdir(out)) - before:
                _remove(out / name)
        raise


@contextlib.contextmanager
def staged(out: str | Path) -> Iterator[Path]:
    """A hidden directory beside ``out`` (new, or an empty directory) to write into; it
    becomes ``out`` in one rename when the block ends, and is removed if it raises."""
    out = Path(out).expanduser()
    created = _first_missing(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as mkdir would make it (mkdtemp's is owner-only)
    try:
        yield staging
        os.replace(staging, out)  # over an empty directory, or none
    except BaseException as e:
        _remove(staging)
        if created is not None:
            _remove(created)
        if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ValueError(f"{out} is no longer empty; nothing was written") from None
        raise
