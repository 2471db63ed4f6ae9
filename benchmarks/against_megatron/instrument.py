"""Clocks on both sides' steps, and a reproducible background load.

``CLOCK`` adds up the seconds spent inside collectives (torch.distributed's, mtcore's
shared-memory channel's, and ``wait()`` on their handles) and records when
``torch.autograd.backward`` is entered and left, while ``on``. Megatron's pipeline
schedules run backward through ``custom_backward`` (the autograd engine directly),
and mtcore's pipeline calls backward once per micro-batch: the forward / backward
split is reported only for a step with exactly one ``torch.autograd.backward``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import time

import torch

COLLECTIVES = (
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "all_to_all_single", "all_gather", "all_gather_single", "reduce_scatter_single",
)  # fmt: skip


class Clock:
    def __init__(self):
        self.on = False
        self.reset()

    def reset(self):
        self.comm, self.calls, self.backwards = 0.0, 0, 0
        self.bwd_start = self.bwd_end = None


CLOCK = Clock()


class _TimedWork:
    def __init__(self, work):
        self._work = work

    def wait(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*a, **k)
        finally:
            CLOCK.comm += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed_collective(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not CLOCK.on:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        CLOCK.comm += time.perf_counter() - t0
        CLOCK.calls += 1
        return _TimedWork(out) if kwargs.get("async_op") and out is not None else out

    return call


def _timed_backward(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not CLOCK.on:
            return fn(*args, **kwargs)
        CLOCK.backwards += 1
        CLOCK.bwd_start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.bwd_end = time.perf_counter()

    return call


def instrument() -> None:
    """Wrap the collectives both sides call and ``torch.autograd.backward``; before
    Megatron is imported (it binds ``all_gather_into_tensor`` at import)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _timed_collective(getattr(dist, name)))
    torch.autograd.backward = _timed_backward(torch.autograd.backward)
    from mtcore.backend.shared_memory import SharedMemoryChannel  # mtcore's tp/dp/ep groups

    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        setattr(SharedMemoryChannel, name, _timed_collective(getattr(SharedMemoryChannel, name)))


def timed_phases(step, batch) -> dict[str, float]:
    """One step under the clock: its time, the collective wait and calls, and (one
    backward call only) forward / backward / optimizer-and-rest."""
    CLOCK.reset()
    CLOCK.on = True
    t0 = time.perf_counter()
    step(batch)
    end = time.perf_counter()
    CLOCK.on = False
    out = {"step": end - t0, "collective wait": CLOCK.comm, "collective calls": CLOCK.calls}
    if CLOCK.backwards == 1:
        out["forward"] = CLOCK.bwd_start - t0
        out["backward"] = CLOCK.bwd_end - CLOCK.bwd_start
        out["optimizer+rest"] = end - CLOCK.bwd_end
    return out


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


@contextlib.contextmanager
def spin_load(k: int):
    """K processes spinning on integer arithmetic until the block ends (K = 0: none)."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()
