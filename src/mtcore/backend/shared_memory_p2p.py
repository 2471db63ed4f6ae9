"""Sends and receives between same-host ranks through shared memory (pipeline stages).

On gloo a pipeline's activations and gradients travel over loopback TCP, each transfer
woken on worker threads of both ranks: inside a step that is milliseconds per transfer,
and 1F1B puts every transfer of a stage boundary on the critical path. A
``SharedMemoryMailbox`` moves them on the calling threads instead, through a segment
its group's members map (the pp group's, made with ``new_group(..., p2p=True)``).

Layout: for every ordered pair of neighbouring members (group ranks ``r`` and
``r + 1 mod n``, both ways) a ring of ``RING_SLOTS`` slots of ``SLOT_BYTES`` and two
counters in the first pages: ``written`` (slots the sender has filled; only it stores
it) and ``read`` (slots the receiver has emptied; only it stores it). A message is cut
into slot-sized pieces, one slot each; the sender fills slot ``written % RING_SLOTS``
when ``written - read < RING_SLOTS``, then publishes ``written + 1`` (x86-64 stores
become visible in program order: ``shared_memory.supported_here``).

Sends never block: pieces that find the ring full stay queued with the sender and go
out as slots are emptied, whenever the sender next calls the mailbox or waits on any
of its handles. Receives from a sender are matched in posting order, as c10d matches
them; a posted receive is filled as soon as its pieces arrive, during any call or
wait. So a rank waiting on anything keeps both directions moving, and two ranks with
full rings in both directions, each waiting on its send, cannot deadlock (each empties
the other's ring into its posted receives). Waits sleep on a futex of the counter they
need, and wake every 100 µs instead while transfers the other way are pending (queued
sends while receiving, posted receives while sending); a peer that exits or stops
answering raises ``PeerGone`` as the channel does.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import torch

from mtcore.backend.shared_memory import (
    PeerGone,
    _low_word,
    futex_wait,
    futex_wake,
    map_segment,
    name_members,
    pid_alive,
)

SLOT_BYTES = 1 << 20  # a [1, 256, 256] fp32 activation is a quarter of one
RING_SLOTS = 4
_PAGE = 4096
_COUNTER_STRIDE = 8  # int64s between counters: one 64-byte cache line each
_SPIN_S = 50e-6
_POLL_S = 100e-6  # between checks while other transfers are also pending
_LIVENESS_EVERY_S = 1.0


def neighbour_pairs(members: int) -> list[tuple[int, int]]:
    """The ordered (sender, receiver) group-rank pairs that get a ring."""
    pairs = []
    for r in range(members):
        for a, b in ((r, (r + 1) % members), ((r + 1) % members, r)):
            if a != b and (a, b) not in pairs:
                pairs.append((a, b))
    return pairs


def mailbox_bytes(members: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The size of a group's mailbox segment: counter pages and the rings."""
    return _counter_bytes(members) + len(neighbour_pairs(members)) * RING_SLOTS * slot_bytes


def _counter_bytes(members: int) -> int:
    words = 2 * len(neighbour_pairs(members)) * _COUNTER_STRIDE
    return -(-words * 8 // _PAGE) * _PAGE


class _Message:
    """One send or receive: its bytes, how many are through, and whether it is done."""

    def __init__(self, tensor: torch.Tensor, receiving: bool):
        self.target = tensor
        if receiving and not tensor.is_contiguous():
            staged = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        else:
            staged = tensor.contiguous()
        self.staged = staged
        self.data = staged.view(-1).view(torch.uint8) if staged.numel() else None
        self.nbytes = staged.numel() * staged.element_size()
        self.moved = 0
        self.done = self.nbytes == 0

    def finish(self) -> None:
        self.done = True
        if self.staged is not self.target:
            self.target.copy_(self.staged)


class _MailboxWork:
    """The handle of one send or receive (the c10d Work interface the runner uses)."""

    def __init__(self, mailbox: SharedMemoryMailbox, message: _Message, peer: int, receiving):
        self._mailbox, self._message = mailbox, message
        self._peer, self._receiving = peer, receiving

    def is_completed(self) -> bool:
        if not self._message.done:
            self._mailbox.progress()
        return self._message.done

    def wait(self) -> bool:
        self._mailbox.wait_for(self._message, self._peer, self._receiving)
        return True


class SharedMemoryMailbox:
    """One group's mailbox segment, mapped by this rank (group rank ``rank`` of
    ``len(pids)``): sends to and receives from its neighbours in the group."""

    def __init__(
        self, path: str, rank: int, pids: Sequence[int], timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ):  # fmt: skip
        self.rank, self.members, self.slot_bytes = rank, len(pids), slot_bytes
        self.pids, self.timeout_s = tuple(pids), timeout_s
        self.global_ranks = tuple(range(self.members))  # the collective sets the real ones
        self._map = map_segment(path, mailbox_bytes(self.members, slot_bytes))
        counters = _counter_bytes(self.members)
        self._counters = memoryview(self._map)[:counters].cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        base = self._bytes.data_ptr()
        self._rings: dict[tuple[int, int], tuple[int, int, int]] = {}  # pair -> words, data
        for i, pair in enumerate(neighbour_pairs(self.members)):
            written, read = 2 * i * _COUNTER_STRIDE, (2 * i + 1) * _COUNTER_STRIDE
            self._rings[pair] = (written, read, counters + i * RING_SLOTS * slot_bytes)
        self._address = lambda word: base + word * 8
        self._outgoing = {dst: collections.deque() for s, dst in self._rings if s == rank}
        self._incoming = {src: collections.deque() for src, d in self._rings if d == rank}
        self._written = dict.fromkeys(self._outgoing, 0)  # this rank's own counters
        self._read = dict.fromkeys(self._incoming, 0)

    def serves(self, peer: int) -> bool:
        """Whether transfers with group rank ``peer`` go through the mailbox (a neighbour)."""
        return (self.rank, peer) in self._rings

    def send(self, tensor: torch.Tensor, peer: int) -> _MailboxWork:
        return self._post(tensor, peer, receiving=False)

    def recv(self, tensor: torch.Tensor, peer: int) -> _MailboxWork:
        return self._post(tensor, peer, receiving=True)

    def _post(self, tensor: torch.Tensor, peer: int, receiving: bool) -> _MailboxWork:
        message = _Message(tensor, receiving=receiving)
        if not message.done:
            (self._incoming if receiving else self._outgoing)[peer].append(message)
        self.progress()
        return _MailboxWork(self, message, peer, receiving=receiving)

    # -- moving pieces -------------------------------------------------------------------
    def progress(self) -> None:
        """Move every piece that can move now, both ways; never waits."""
        for peer, queue in self._outgoing.items():
            if queue:
                self._push(peer, queue)
        for peer, queue in self._incoming.items():
            if queue:
                self._pull(peer, queue)

    def _slot(self, data_at: int, index: int) -> torch.Tensor:
        start = data_at + (index % RING_SLOTS) * self.slot_bytes
        return self._bytes[start : start + self.slot_bytes]

    def _push(self, peer: int, queue: collections.deque) -> None:
        written_word, read_word, data_at = self._rings[(self.rank, peer)]
        counters = self._counters
        while queue:
            message = queue[0]
            while message.moved < message.nbytes:
                written = self._written[peer]
                if written - counters[read_word] >= RING_SLOTS:
                    return
                n = min(self.slot_bytes, message.nbytes - message.moved)
                self._slot(data_at, written)[:n].copy_(
                    message.data[message.moved : message.moved + n]
                )
                message.moved += n
                self._written[peer] = written + 1
                counters[written_word] = written + 1
                futex_wake(self._address(written_word))
            message.finish()
            queue.popleft()

    def _pull(self, peer: int, queue: collections.deque) -> None:
        written_word, read_word, data_at = self._rings[(peer, self.rank)]
        counters = self._counters
        while queue:
            message = queue[0]
            while message.moved < message.nbytes:
                read = self._read[peer]
                if counters[written_word] <= read:
                    return
                n = min(self.slot_bytes, message.nbytes - message.moved)
                message.data[message.moved : message.moved + n].copy_(self._slot(data_at, read)[:n])
                message.moved += n
                self._read[peer] = read + 1
                counters[read_word] = read + 1
                futex_wake(self._address(read_word))
            message.finish()
            queue.popleft()

    # -- waiting -------------------------------------------------------------------------
    def wait_for(self, message: _Message, peer: int, receiving: bool) -> None:
        """Until ``message`` is through, moving everything else meanwhile."""
        pair = (peer, self.rank) if receiving else (self.rank, peer)
        word = self._rings[pair][0 if receiving else 1]  # the counter the peer moves next
        start = time.perf_counter()
        next_check = _LIVENESS_EVERY_S
        while True:
            seen = self._counters[word]  # read before moving: a later store wakes the sleep
            self.progress()
            if message.done:
                return
            waited = time.perf_counter() - start
            if waited < _SPIN_S:
                continue
            if waited >= next_check:
                next_check += _LIVENESS_EVERY_S
                self._check_peer(peer, waited)
            # Other transfers that need the other counter to move: check them now and then.
            others = self._outgoing if receiving else self._incoming
            polling = any(others.values())
            sleep_s = _POLL_S if polling else max(next_check - waited, 1e-3)
            if not futex_wait(self._address(word), _low_word(seen), sleep_s):
                time.sleep(_POLL_S)

    def _check_peer(self, peer: int, waited: float) -> None:
        if not pid_alive(self.pids[peer]):
            raise PeerGone(
                f"shared-memory mailbox: {name_members(self, [peer])} exited while this "
                f"rank waited {waited:.1f} s for a transfer with it"
            )
        if waited > self.timeout_s:
            raise PeerGone(
                f"shared-memory mailbox: a transfer with {name_members(self, [peer])} did "
                f"not complete within {self.timeout_s:g} s"
            )

    def close(self) -> None:
        try:
            del self._bytes, self._counters
            self._map.close()
        except (AttributeError, BufferError):
            pass
