"""Directories the job will write, checked before it trains.

An unwritable ``checkpoint.dir`` otherwise surfaces at the first save, after
every step until then was computed for nothing (at the final save, the whole
run), and an unwritable ``data.cache_dir`` as a traceback from deep inside the
data layer. Permission bits cannot tell: root ignores them, and a read-only or
full mount, or a path under a regular file, passes ``os.access``. So the check
does what the job will do: create (and remove) a probe file, in the directory
or, when it does not exist yet, in its nearest existing parent, where the job's
``mkdir`` will have to write. Nothing is left behind, not even the directory.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from mtcore.training.config import ConfigError


def check_writable(key: str, path: str | Path) -> None:
    """Raise a ConfigError naming ``key`` and ``path`` when a directory cannot be made
    or written there."""
    given = Path(path).expanduser()
    target = given
    while not target.exists() and target != target.parent:
        target = target.parent
    if not target.is_dir():
        what = "is a file" if target == given else f"is under {target}, which is a file"
        raise ConfigError(f"{key} {given} cannot be a directory: it {what}")
    probe = target / f".mtcore-write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        where = "" if target == given else f" (creating it in {target})"
        raise ConfigError(f"{key} {given} is not writable{where}: {e.strerror or e}") from e


def check_output_dirs(config, rank: int) -> None:
    """Every directory this rank writes: the data cache and checkpoints on every rank
    (each rank writes its own checkpoint shards), TensorBoard events on rank 0 only."""
    data = config.data
    if hasattr(data, "resolved_cache_dir"):
        check_writable("data.cache_dir", data.resolved_cache_dir())
    if config.checkpoint.dir is not None:
        check_writable("checkpoint.dir", config.checkpoint.dir)
    if rank == 0 and config.logging.tensorboard_dir:
        check_writable("logging.tensorboard_dir", config.logging.tensorboard_dir)
