"""The shared-memory channel on its own: real segments in /dev/shm, real processes.

The collectives through it, inside c10d groups, are checked in
tests/distributed/test_shared_memory_collective.py; here a peer that never arrives,
hangs or exits, and the segment's life, which a multi-rank run cannot provoke.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import time

import pytest
import torch

from mtcore.backend import shared_memory
from mtcore.backend.collective import CollectiveTimeout, _named
from mtcore.backend.shared_memory import PeerGone, SharedMemoryChannel

pytestmark = pytest.mark.skipif(
    not shared_memory.supported_here(), reason="needs x86-64 and /dev/shm"
)


def _absent_peer(path: str, ready, release) -> None:
    """Map the segment as group rank 1, say so, then never take part in a round."""
    channel = SharedMemoryChannel(path, 1, [0, 0], timeout_s=60)
    ready.set()
    release.wait(30)
    channel.close()


def test_a_peer_that_hangs_then_exits_is_named_and_the_segment_leaves_nothing():
    """Named by its global rank, pid and host, not by its rank inside the group."""
    path = shared_memory.create_segment(2)
    assert path is not None and os.path.exists(path)
    context = mp.get_context("spawn")
    ready, release = context.Event(), context.Event()
    peer = context.Process(target=_absent_peer, args=(path, ready, release), daemon=True)
    peer.start()
    try:
        assert ready.wait(60), "the peer did not map the segment"
        channel = SharedMemoryChannel(path, 0, [os.getpid(), peer.pid], timeout_s=0.2)
    finally:
        shared_memory.unlink_segment(path)  # as the collective does once all have mapped
    assert not os.path.exists(path)
    channel.global_ranks = (6, 7)  # what the collective sets: the members' global ranks
    host = socket.gethostname()
    start = time.perf_counter()
    hung_peer = rf"rank\(s\) 7 \(pid {peer.pid} on host {host}\) did not arrive within 0.2 s"
    with pytest.raises(PeerGone, match=hung_peer):
        channel.all_reduce(torch.ones(4))
    hung = time.perf_counter() - start
    release.set()
    peer.join(30)
    start = time.perf_counter()
    with pytest.raises(PeerGone, match=rf"rank\(s\) 7 \(pid {peer.pid} on host {host}\) exited"):
        channel.all_reduce(torch.ones(4))
    gone = time.perf_counter() - start
    channel.close()
    # each noticed at the first liveness check (one second into the wait)
    assert hung < 5 and gone < 5, (hung, gone)


def _late_peer(path: str, ready, go, late_s: float) -> None:
    """Group rank 1: map the segment, then join one all-reduce ``late_s`` after ``go``."""
    channel = SharedMemoryChannel(path, 1, [0, 0], timeout_s=60)
    ready.set()
    go.wait(30)
    time.sleep(late_s)
    x = torch.full((4,), 2.0)
    channel.all_reduce(x)
    channel.close()


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_polling():
    """Half a second of waiting costs a handful of wake-ups and no CPU to speak of (it
    slept in the kernel); polling every 50 us woke thousands of times."""
    path = shared_memory.create_segment(2)
    context = mp.get_context("spawn")
    ready, go = context.Event(), context.Event()
    peer = context.Process(target=_late_peer, args=(path, ready, go, 0.5), daemon=True)
    peer.start()
    try:
        assert ready.wait(60), "the peer did not map the segment"
        channel = SharedMemoryChannel(path, 0, [os.getpid(), peer.pid], timeout_s=60)
    finally:
        shared_memory.unlink_segment(path)
    x = torch.ones(4)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    go.set()
    channel.all_reduce(x)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    peer.join(30)
    channel.close()
    assert torch.equal(x, torch.full((4,), 3.0))
    wakeups = after.ru_nvcsw - before.ru_nvcsw
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert wakeups <= 10, wakeups
    assert cpu_s < 0.05, cpu_s


def test_a_segment_is_refused_when_shm_lacks_the_room(monkeypatch):
    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(shared_memory.os, "statvfs", lambda path: Full())
    assert shared_memory.create_segment(2) is None


def test_a_zombie_is_not_alive():
    child = os.fork() if hasattr(os, "fork") else None
    if child == 0:
        os._exit(0)
    deadline = time.time() + 10
    while shared_memory.pid_alive(child) and time.time() < deadline:
        time.sleep(0.01)
    assert not shared_memory.pid_alive(child)  # exited, not yet reaped
    os.waitpid(child, 0)
    assert not shared_memory.pid_alive(child)
    assert shared_memory.pid_alive(os.getpid())


def test_a_lost_peer_becomes_a_collective_timeout_naming_the_call():
    expected = r"^all_reduce: rank 1 exited"
    with pytest.raises(CollectiveTimeout, match=expected), _named(lambda: "all_reduce", 5.0):
        raise PeerGone("rank 1 exited")


def test_the_channel_serves_contiguous_cpu_tensors_and_the_four_reductions():
    path = shared_memory.create_segment(1)
    channel = SharedMemoryChannel(path, 0, [os.getpid()], timeout_s=5)
    shared_memory.unlink_segment(path)
    x = torch.arange(6.0).reshape(2, 3)
    assert channel.takes(x, op="sum") and channel.takes(x, op="avg")
    assert not channel.takes(x.t(), op="sum")  # not contiguous
    assert not channel.takes(x, op="product")
    assert not channel.takes(torch.arange(3), op="avg")  # an integer mean
    assert not channel.takes(torch.ones(2, dtype=torch.bool))
    assert not channel.takes(torch.ones(2, dtype=torch.complex64))
    channel.close()


def test_a_parameter_is_reduced_in_place_as_gloo_would_reduce_it():
    """Collectives move data, not autograd history: a leaf that requires grad (a tied
    weight synchronised by value) is written in place, with no autograd error."""
    path = shared_memory.create_segment(1)
    channel = SharedMemoryChannel(path, 0, [os.getpid()], timeout_s=5)
    shared_memory.unlink_segment(path)
    weight = torch.nn.Parameter(torch.arange(4.0))
    channel.all_reduce(weight, op="max")
    out = torch.empty(4)
    channel.all_gather(out, weight)
    assert torch.equal(weight.detach(), torch.arange(4.0)) and torch.equal(out, torch.arange(4.0))
    channel.close()
