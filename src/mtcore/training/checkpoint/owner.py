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

An elastic job restarts its ranks (a rank died, a node was lost or partitioned
away) while a rank of the earlier incarnation may still be alive on a node the
others no longer reach. Each incarnation has its own token, kept in the record
with the job's run id (torch's rendezvous id): a new incarnation waits a while
for an earlier one of the same job to let go, then takes the directory over,
and ``DirectoryLock.fence`` makes the earlier one's commits fail from then on
(``Checkpointer`` asks before every commit), so a process left behind never
writes ``latest`` or a step directory again.

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
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from mtcore.training.checkpoint.manifest import CheckpointError

LOCK_FILE = "owner.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats


class DirectoryLock:
    """The held lock of one checkpoint root (rank 0). ``notice``: the message of a stale
    lock taken over, or None; ``record``: what the lock file says of this owner."""

    def __init__(self, fd: int, path: Path, notice: str | None, record: dict):
        self.fd, self.path, self.notice, self.record = fd, path, notice, record
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

    def fence(self) -> str | None:
        """None while this process still owns the directory; else why it does not (another
        incarnation of the job took it over): its saves must not commit."""
        try:
            current = json.loads(self.path.read_text())
        except (OSError, ValueError):
            current = None
        if isinstance(current, dict) and current.get("incarnation") == self.record["incarnation"]:
            return None
        who = _describe(current) if isinstance(current, dict) else "nobody (the lock file is gone)"
        return (
            f"checkpoint.dir {self.path.parent} now belongs to {who}; this process "
            f"(incarnation {self.record['incarnation']}) was left behind and commits nothing"
        )

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


def acquire(
    root: str | Path,
    run_id: str | None = None,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> DirectoryLock:
    """Lock ``root`` for this process, or raise a CheckpointError naming the owner.

    ``run_id``: the job's id (None: no elastic job). A live owner with the same id is an
    earlier incarnation of this job: wait up to ``wait_s`` for it to end (``say`` is told
    once), then take the directory over from it (its ``fence`` fails from then on)."""
    root = Path(root).expanduser()
    path = root / LOCK_FILE
    deadline = time.monotonic() + wait_s
    waiting = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # the owner may release (unlink) between our open and flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while not (locked := _flock(fd)):
                    owner = _owner_record(fd)
                    if run_id is None or owner is None or owner.get("run_id") != run_id:
                        raise CheckpointError(_in_use(root, path, owner))
                    if time.monotonic() >= deadline:
                        _take_over(fd, path, owner, say)
                        break
                    if not waiting and say is not None:
                        say(
                            f"checkpoint: waiting up to {wait_s:g} s for an earlier incarnation "
                            f"of this job ({_describe(owner)}) to release {path}"
                        )
                    waiting = True
                    time.sleep(0.2)
                lock = _claim_file(fd, root, path, run_id) if locked else None
            except BaseException:
                os.close(fd)
                raise
            if lock is not None:
                return lock
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot lock checkpoint.dir {root}: {e.strerror or e}") from e
    raise CheckpointError(f"cannot lock checkpoint.dir {root}: {path} keeps being replaced")


def _flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _take_over(fd: int, path: Path, owner: dict, say) -> None:
    """Unlink the lock file a live earlier incarnation holds: the next open makes a new one,
    whose record (a new incarnation) fences the old owner's commits."""
    if _same_file(fd, path):
        path.unlink()
    if say is not None:
        say(
            f"checkpoint: taking over {path} from an earlier incarnation of this job "
            f"({_describe(owner)}) that still holds it (a node cut off?); it commits nothing now"
        )


def _claim_file(fd: int, root: Path, path: Path, run_id: str | None) -> DirectoryLock | None:
    if not _same_file(fd, path):
        return None  # locked a file its owner just removed: try again
    previous = _read(fd)
    notice = None
    if previous is not None:
        age = time.time() - os.fstat(fd).st_mtime
        host = previous.get("host")
        ours = run_id is not None and previous.get("run_id") == run_id
        if host is not None and host != socket.gethostname() and age < STALE_AFTER_S and not ours:
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
        "run_id": run_id,
        "incarnation": uuid.uuid4().hex[:12],
    }
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    return DirectoryLock(fd, path, notice, record)


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


@dataclass
class Ownership:
    """Every rank's share of the job's claim on its checkpoint root: the incarnation that
    names this run's saves, and rank 0's lock (None elsewhere)."""

    incarnation: str
    lock: DirectoryLock | None = None

    @property
    def notice(self) -> str | None:
        return self.lock.notice if self.lock is not None else None

    def fence(self) -> str | None:
        """Rank 0: why its commits must stop (``DirectoryLock.fence``); None elsewhere."""
        return self.lock.fence() if self.lock is not None else None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def claim(
    root: str | Path | None,
    backend,
    rank: int,
    world: int,
    run_id: str | None = None,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> Ownership | None:
    """Rank 0 locks ``root`` and every rank learns the outcome (collective): all of them
    raise the same CheckpointError when it is refused, so no rank trains alone or waits
    in a collective that the others never join. None: no root. ``run_id``, ``wait_s``,
    ``say``: as for ``acquire`` (keep ``wait_s`` below the collective timeout: the other
    ranks wait for rank 0 in a collective)."""
    from mtcore.training.checkpoint.checkpointer import gather_json

    if root is None:
        return None
    lock, outcome = None, {}
    if rank == 0:
        try:
            lock = acquire(root, run_id, wait_s, say)
            outcome = {"error": None, "incarnation": lock.record["incarnation"]}
        except CheckpointError as e:
            outcome = {"error": str(e)}
    outcome = gather_json(outcome, backend.collective, world, backend.torch_device())
    if outcome["error"] is not None:
        raise CheckpointError(outcome["error"])
    return Ownership(outcome["incarnation"], lock)
