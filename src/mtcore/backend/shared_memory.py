"""Collectives among the ranks of one host through a shared-memory segment.

gloo moves every tensor over loopback TCP on worker threads: a 1 MiB all-reduce
between two ranks costs 0.5 ms in a tight loop but 1-5 ms inside a training step,
most of it waking those threads on a rank's one core (docs/results/megatron.md).
For the small, frequent, blocking calls of tensor parallelism on CPU ranks that
share a host, a ``SharedMemoryChannel`` does the work on the calling thread
instead: each rank copies its tensor into its own slot of a segment mapped by every
member, publishes a sequence number, waits until every member has published the
same number, and reads the others' slots. No thread is woken and no byte crosses
a socket.

The protocol, per round (a tensor larger than a slot takes several rounds):

1. round ``k`` uses slot set ``k % 2``; rank ``r`` writes only its own slot;
2. rank ``r`` stores ``k`` in its flag, then waits until every flag is ``>= k``;
3. every rank reads every slot and writes its result (a reduction sums the slots
   in rank order, so every rank gets the same bits; an all-to-all reads its part of
   each slot, the parts' sizes agreed in the first round's slot headers).

Rank ``r`` overwrites a slot set only at round ``k + 2``, after it saw every flag
reach ``k + 1``, which each peer stores only after it finished reading round ``k``:
two slot sets are enough, and no second synchronisation is needed. Correctness
rests on stores becoming visible in program order and loads not passing loads,
which x86-64 guarantees (total store order); ``supported_here()`` is false on any
other machine, and the collective keeps gloo there.

Waiting spins for a short while (``_SPIN_S``: a peer a few microseconds behind is
caught without a system call), then sleeps in the kernel on the first missing peer's
flag (a futex on the shared mapping: ``FUTEX_WAIT`` while the flag still holds the
value seen); every rank wakes its flag's sleepers after publishing. A sleeping rank
uses no CPU, so on a machine with more busy processes than cores the peer it waits
for gets the core (spinning, then polling every 50 µs, made a waiting rank compete
with it: issue 33). A peer that exits is noticed within a second (the sleep times out
to check its pid) and a peer that hangs after the group's timeout: both raise
``CollectiveTimeout`` naming the call, as gloo would.

The segment lives in ``/dev/shm`` only until every member has mapped it; it is
unlinked then, so nothing is left behind when a rank dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import platform
import secrets
import time
from collections.abc import Sequence

import torch

SHM_DIR = "/dev/shm"
SLOT_BYTES = 2 << 20  # per rank and slot set: a 1 MiB activation travels in one round
_PAGE = 4096
_FLAG_STRIDE = 8  # int64s between flags: one 64-byte cache line each
_SPIN_S = 50e-6  # spin this long before sleeping on a futex
_LIVENESS_EVERY_S = 1.0
_SYS_FUTEX = 202  # x86-64 (the only machine the channel runs on)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_WAKE_ALL = 0x7FFFFFFF
_POLL_S = 50e-6  # only where the futex call fails (a sandbox that refuses it)
_REDUCTIONS = ("sum", "avg", "max", "min")
_X86_64 = ("x86_64", "amd64")
_A2A_HEADER = 64  # all-to-all: a slot starts with the rounds its writer needs (int64)


def supported_here() -> bool:
    """Whether this machine can run the channel: an x86-64 CPU and a ``/dev/shm``."""
    return platform.machine().lower() in _X86_64 and os.path.isdir(SHM_DIR)


def segment_bytes(members: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The size of a group's segment: a page of flags and two slot sets."""
    return _PAGE + 2 * members * slot_bytes


def create_segment(members: int, slot_bytes: int = SLOT_BYTES, size: int | None = None) -> str | None:
    """Create a zeroed segment for a group (on its first rank): a channel's, or ``size``
    bytes; its path, or None if ``/dev/shm`` lacks the room (the group then keeps its
    c10d backend)."""
    size = segment_bytes(members, slot_bytes) if size is None else size
    stat = os.statvfs(SHM_DIR)
    if stat.f_bavail * stat.f_frsize < 2 * size:
        return None
    path = os.path.join(SHM_DIR, f"mtcore-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


def map_segment(path: str, size: int) -> mmap.mmap:
    """Map a group's segment, made by its first member, after checking it has ``size``
    bytes (a channel's or a mailbox's)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink_segment(path: str) -> None:
    """Remove the segment's name; the members' mappings stay valid."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def futex_wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (as a signed 32-bit
    value), at most ``timeout_s``; False when the kernel refused the call (the caller
    then polls). A change before the call, a wake and the timeout all return True."""
    seconds = int(timeout_s)
    timeout = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    result = _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(expected), ctypes.byref(timeout), None, ctypes.c_int(0),
    )  # fmt: skip
    return result == 0 or ctypes.get_errno() in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_WAKE_ALL), None, None, ctypes.c_int(0),
    )  # fmt: skip


def _low_word(value: int) -> int:
    """The low 32 bits of an int64 flag as a signed 32-bit int (the futex word on a
    little-endian machine)."""
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


class PeerGone(RuntimeError):
    """A member of the channel exited or stopped answering; the message says which."""


class SharedMemoryChannel:
    """One group's segment, mapped by this rank: all-reduce, all-gather, reduce-scatter
    and all-to-all of CPU tensors among ``len(pids)`` same-host ranks."""

    def __init__(
        self,
        path: str,
        rank: int,
        pids: Sequence[int],
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ):
        self.rank, self.members, self.slot_bytes = rank, len(pids), slot_bytes
        self.timeout_s = timeout_s
        self.pids = tuple(pids)
        self.global_ranks = tuple(range(self.members))  # the collective sets the real ones
        self._map = map_segment(path, segment_bytes(self.members, slot_bytes))
        self._flags = memoryview(self._map)[:_PAGE].cast("q")
        self._flag_slots = [r * _FLAG_STRIDE for r in range(self.members)]
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        base = self._bytes.data_ptr()
        self._flag_addresses = [base + slot * 8 for slot in self._flag_slots]
        self._round = 0
        self._whole_slot = torch.empty(slot_bytes, dtype=torch.uint8, device="meta")

    # -- the three operations ----------------------------------------------------------
    def takes(self, *tensors: torch.Tensor, op: str | None = None) -> bool:
        """Whether the channel serves this call (else the c10d backend does)."""
        if op is not None and op not in _REDUCTIONS:
            return False
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                return False
            if tensor.is_complex() or tensor.dtype == torch.bool:
                return False
            if op == "avg" and not tensor.is_floating_point():
                return False
        return True

    @torch.no_grad()
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` in place; every rank gets the same bits."""
        flat = tensor.view(-1)
        per_round = self.slot_bytes // tensor.element_size()
        for lo in range(0, flat.numel(), per_round):
            piece = flat[lo : lo + per_round]
            slots = self._exchange(lambda mine, piece=piece: mine.copy_(piece), piece)
            _reduce(slots, piece, op, self.members)

    @torch.no_grad()
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (flat: members x input) gets every rank's ``input`` in rank order."""
        source, target = input.view(-1), output.view(self.members, -1)
        per_round = self.slot_bytes // input.element_size()
        for lo in range(0, source.numel(), per_round):
            piece = source[lo : lo + per_round]
            slots = self._exchange(lambda mine, piece=piece: mine.copy_(piece), piece)
            for member, slot in enumerate(slots):
                target[member, lo : lo + piece.numel()].copy_(slot)

    @torch.no_grad()
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None:
        """``output`` gets this rank's dim-0 shard of the reduction of ``input``."""
        shards, target = input.view(self.members, -1), output.view(-1)
        per_round = self.slot_bytes // (input.element_size() * self.members)
        for lo in range(0, target.numel(), per_round):
            pieces = shards[:, lo : lo + per_round]
            width = pieces.shape[1]
            slots = self._exchange(
                lambda mine, pieces=pieces: mine.view(pieces.shape).copy_(pieces), pieces
            )
            own = [slot[self.rank * width : (self.rank + 1) * width] for slot in slots]
            _reduce(own, target[lo : lo + width], op, self.members)

    @torch.no_grad()
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        """Rows (dim 0) of ``input``, ``input_splits[d]`` for member ``d`` in member order,
        go to member ``d``; ``output`` gets member ``s``'s ``output_splits[s]`` rows in
        member order (the rows must fit a slot's share: ``fits_rows``).

        Each round, a rank's slot holds a header (the rounds it needs) and one part per
        member, of up to ``q`` rows of what goes to that member; the first round's
        headers tell every member how many rounds the call takes, so all of them make
        the same number. The bytes are copied as they are: the same bits as gloo."""
        row_bytes = _row_bytes(input)
        q = self._rows_per_part(row_bytes)
        src = input.contiguous().view(-1).view(torch.uint8)
        dst = output if output.is_contiguous() else torch.empty_like(output)
        out = dst.view(-1).view(torch.uint8)
        send_at, recv_at = _offsets(input_splits), _offsets(output_splits)
        need = max([-(-n // q) for n in (*input_splits, *output_splits) if n] + [1])
        part = (self.slot_bytes - _A2A_HEADER) // self.members
        total, j = need, 0
        while j < total:
            lo = j * q

            def fill(mine, lo=lo):
                mine[:8].view(torch.int64)[0] = need
                for member, (first, count) in enumerate(zip(send_at, input_splits, strict=True)):
                    n = min(max(count - lo, 0), q) * row_bytes
                    if n:
                        start = (first + lo) * row_bytes
                        at = _A2A_HEADER + member * part
                        mine[at : at + n].copy_(src[start : start + n])

            slots = self._exchange(fill, self._whole_slot)
            if j == 0:
                total = max(int(slot[:8].view(torch.int64)[0]) for slot in slots)
            at = _A2A_HEADER + self.rank * part
            for member, (first, count) in enumerate(zip(recv_at, output_splits, strict=True)):
                n = min(max(count - lo, 0), q) * row_bytes
                if n:
                    start = (first + lo) * row_bytes
                    out[start : start + n].copy_(slots[member][at : at + n])
            j += 1
        if dst is not output:
            output.copy_(dst)

    def fits_rows(self, tensor: torch.Tensor) -> bool:
        """Whether the channel serves an all-to-all of ``tensor``'s rows: a CPU tensor
        whose dim-0 row fits a member's part of a slot (every member answers alike)."""
        if tensor.device.type != "cpu" or tensor.dim() == 0:
            return False
        return self._rows_per_part(_row_bytes(tensor)) > 0

    def _rows_per_part(self, row_bytes: int) -> int:
        part = (self.slot_bytes - _A2A_HEADER) // self.members
        return part // row_bytes if row_bytes else 1 << 62

    def close(self) -> None:
        try:
            del self._bytes, self._flags
            self._map.close()
        except (AttributeError, BufferError):
            pass  # a view is still alive somewhere; the mapping goes with the process

    # -- one round -----------------------------------------------------------------------
    def _exchange(self, fill, like: torch.Tensor) -> list[torch.Tensor]:
        """Write this rank's part (``fill`` gets the slot, typed and shaped flat like
        ``like``), publish it, wait for every member's, and return all slots typed alike."""
        self._round += 1
        slot_set = self._round % 2
        nbytes = like.numel() * like.element_size()
        slots = []
        for member in range(self.members):
            start = _PAGE + (slot_set * self.members + member) * self.slot_bytes
            slots.append(self._bytes[start : start + nbytes].view(like.dtype))
        fill(slots[self.rank])
        self._flags[self._flag_slots[self.rank]] = self._round
        futex_wake(self._flag_addresses[self.rank])
        self._wait_for(self._round)
        return slots

    def _arrived(self, round_: int) -> bool:
        flags = self._flags
        return all(flags[slot] >= round_ for slot in self._flag_slots)

    def _wait_for(self, round_: int) -> None:
        if self._arrived(round_):
            return
        start = time.perf_counter()
        while time.perf_counter() - start < _SPIN_S:
            if self._arrived(round_):
                return
        next_check = _LIVENESS_EVERY_S
        flags = self._flags
        for member, slot in enumerate(self._flag_slots):
            while (seen := flags[slot]) < round_:
                waited = time.perf_counter() - start
                if waited >= next_check:
                    next_check += _LIVENESS_EVERY_S
                    self._check_peers(round_, waited)
                sleep_s = max(next_check - waited, 1e-3)
                if not futex_wait(self._flag_addresses[member], _low_word(seen), sleep_s):
                    time.sleep(_POLL_S)

    def _check_peers(self, round_: int, waited: float) -> None:
        missing = [r for r, slot in enumerate(self._flag_slots) if self._flags[slot] < round_]
        gone = [r for r in missing if not pid_alive(self.pids[r])]
        if gone:
            raise PeerGone(
                f"shared-memory channel: {name_members(self, gone)} exited while this rank "
                f"waited {waited:.1f} s for them"
            )
        if waited > self.timeout_s:
            raise PeerGone(
                f"shared-memory channel: {name_members(self, missing)} did not arrive within "
                f"{self.timeout_s:g} s"
            )


def name_members(segment, members: Sequence[int]) -> str:
    """Members of a channel or mailbox (group ranks) as a user finds them: their global
    ranks, pids and host (one host: the segment is in its /dev/shm)."""
    import socket

    ranks = ", ".join(str(segment.global_ranks[r]) for r in members)
    pids = ", ".join(str(segment.pids[r]) for r in members)
    return f"rank(s) {ranks} (pid {pids} on host {socket.gethostname()})"


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes in one dim-0 row of ``tensor``."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _offsets(splits: Sequence[int]) -> list[int]:
    """The first row of each split."""
    starts, at = [], 0
    for n in splits:
        starts.append(at)
        at += n
    return starts


def _reduce(slots: list[torch.Tensor], out: torch.Tensor, op: str, members: int) -> None:
    """``out`` = the slots combined in rank order (the same bits on every rank)."""
    if members == 1:
        out.copy_(slots[0])
        return
    if op in ("sum", "avg"):
        low_precision = out.is_floating_point() and out.element_size() < 4 and members > 2
        if low_precision:
            total = slots[0].float()
            for slot in slots[1:]:
                total.add_(slot)
            out.copy_(total)
        else:
            torch.add(slots[0], slots[1], out=out)
            for slot in slots[2:]:
                out.add_(slot)
        if op == "avg":
            out.div_(members)
        return
    combine = torch.maximum if op == "max" else torch.minimum
    combine(slots[0], slots[1], out=out)
    for slot in slots[2:]:
        combine(out, slot, out=out)
