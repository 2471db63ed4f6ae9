"""One writer per checkpoint directory: an exclusive lock on ``checkpoint.dir``, held for the job.

Two jobs saving into one root replace each other's steps and ``latest`` (and one
can commit a ``.partial`` directory the other just removed), so rank 0 of a
training job takes ``<root>/owner.lock`` before step 1 and keeps it open until
the job ends.

Why ``fcntl.flock`` on a file kept open, not a file created with O_EXCL: the
kernel drops a flock the moment its process dies, ``kill -9`` included, so on
one host a dead owner can never block the directory, and a reused pid can never
pass for a live owner. The file also records the owner (host, pid, start
time), written after the lock is taken, so a refusal can name it; a record left
behind by a dead owner (its file is only removed on a clean exit) is a stale
lock, taken over with a message.

Across hosts on a shared file system: Linux NFS (v3 through NLM, v4 natively)
and Lustre mounted with ``flock`` enforce the lock on every host, and a crashed
host's lock ends with its lease. Where locks are only local (Lustre
``localflock``, some FUSE file systems), a lock from another host could be
acquired while its owner lives; so the owner refreshes the file's mtime every
``HEARTBEAT_S``, and a record from another host counts as live, whatever the
lock says, until its heartbeat is ``STALE_AFTER_S`` old.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from mtcore.training.checkpoint.manifest import CheckpointError

LOCK_FILE = "owner.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats


class DirectoryLock:
    """The held lock of one checkpoint root (rank 0). ``notice``: the message of a stale
    lock taken over, or None."""

    def __init__(self, fd: int, path: Path, notice: str | None):
        self.fd, self.path, self.notice = fd, path, notice
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, name="mtcore-lock-heartbeat", daemon=True
        )
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)
            except OSError:  # a vanished file system: the job's own saves will report it
                return

    def release(self) -> None:
        """Remove the record, then drop the lock: a job that opened the file meanwhile
        finds it unlinked (``acquire`` checks) and takes a fresh one."""
        if self.fd < 0:
            return
        self._stop.set()
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def acquire(root: str | Path) -> DirectoryLock:
    """Lock ``root`` for this process, or raise a CheckpointError naming the owner."""
    root = Path(root).expanduser()
    path = root / LOCK_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # the owner may release (unlink) between our open and flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                lock = _try_lock(fd, root, path)
            except BaseException:
                os.close(fd)
                raise
            if lock is not None:
                return lock
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot lock checkpoint.dir {root}: {e.strerror or e}") from e
    raise CheckpointError(f"cannot lock checkpoint.dir {root}: {path} keeps being replaced")


def _try_lock(fd: int, root: Path, path: Path) -> DirectoryLock | None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CheckpointError(_in_use(root, path, _owner_record(fd))) from None
    if not _same_file(fd, path):
        return None  # locked a file its owner just removed: try again
    previous = _read(fd)
    notice = None
    if previous is not None:
        age = time.time() - os.fstat(fd).st_mtime
        host = previous.get("host")
        if host is not None and host != socket.gethostname() and age < STALE_AFTER_S:
            raise CheckpointError(
                _in_use(root, path, previous)
                + f" (its heartbeat is {age:.0f} s old; a lock from another host is live"
                f" until {STALE_AFTER_S:.0f} s)"
            )
        notice = (
            f"checkpoint: taking over the stale lock {path}: {_describe(previous)} "
            "no longer holds it"
        )
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    return DirectoryLock(fd, path, notice)


def _in_use(root: Path, path: Path, owner: dict | None) -> str:
    who = _describe(owner) if owner else "another job (its record is not written yet)"
    return (
        f"checkpoint.dir {root} is in use by {who} (lock {path}); "
        "wait for that job to end or choose another checkpoint.dir"
    )


def _describe(owner: dict) -> str:
    return (
        f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, "
        f"started {owner.get('started', '?')}"
    )


def _owner_record(fd: int, patience_s: float = 2.0) -> dict | None:
    """The record of a live owner; two jobs started together can find the lock taken a
    moment before its owner writes who it is, so wait a little for it."""
    deadline = time.monotonic() + patience_s
    while not (record := _read(fd)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return record


def _read(fd: int) -> dict | None:
    """The record in the lock file; None when empty; ``{}`` when unreadable."""
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return {}
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def claim(root: str | Path | None, backend, rank: int, world: int) -> DirectoryLock | None:
    """Rank 0 locks ``root`` and every rank learns the outcome (collective): all of them
    raise the same CheckpointError when it is refused, so no rank trains alone or waits
    in a collective that the others never join. None: no root, or not rank 0."""
    from mtcore.training.checkpoint.checkpointer import gather_json

    if root is None:
        return None
    lock, outcome = None, {}
    if rank == 0:
        try:
            lock = acquire(root)
            outcome = {"error": None}
        except CheckpointError as e:
            outcome = {"error": str(e)}
    outcome = gather_json(outcome, backend.collective, world, backend.torch_device())
    if outcome["error"] is not None:
        raise CheckpointError(outcome["error"])
    return lock
