"""``logging.profile``: torch.profiler over the chosen steps, one Chrome trace per rank.

At the first traced step every rank (traced or not) meets the others in a barrier, so
that ``mtcore trace merge`` can align the ranks' clocks there: the moment each traced
rank leaves it is the trace's ``sync`` mark. The traced ranks record torch.profiler's
events (host ops; the device's too where torch.profiler sees it) and mtcore's own named
phases (``mtcore.backend.tracing``) on two tracks of their own: ``mtcore phases`` (what
this rank's main thread is doing, each range with its category) and ``mtcore in flight``
(asynchronous reductions from launch to completion). After the last traced step each
writes ``rank<r>.json.gz`` (the Trace Event Format, gzip) under ``logging.profile.dir``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch

from mtcore.backend import tracing
from mtcore.backend.tracing import ASYNC, PhaseRecorder
from mtcore.training.trace_format import ASYNC_TID, PHASES_TID, TRACE_KEY


def trace_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json.gz"


class StepProfiler:
    """Opens a profile at step ``steps[0]`` and writes it after ``steps[1]`` (or at
    ``close``, when training ends first). ``config`` None: every call is a no-op."""

    def __init__(self, config, backend, rank: int, world: int, say=None):
        self.config, self.backend, self.rank, self.world = config, backend, rank, world
        self.say = say or (lambda text: None)  # the trainer's rank-0 line
        self.traced = config is not None and (config.ranks == "all" or rank in config.ranks)
        self._profiler = None
        self._recorder: PhaseRecorder | None = None
        self._steps: list[int] = []
        self._closed = False

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one training step: its range ("step N", with the data loading inside)."""
        if self.config is None:
            yield
            return
        first, last = self.config.steps
        if step == first:
            self._open()
        if self._recorder is None:
            yield
            return
        self._steps.append(step)
        with tracing.phase(f"step {step}", "step", step=step):
            yield
        if step >= last:
            self.close()

    def _open(self) -> None:
        if self.traced:
            if self.config.torch_profiler:
                self._profiler = _start_profiler(self.backend, self.config.memory)
            self._recorder = PhaseRecorder(self.backend.device, memory=self.config.memory)
        if self.world > 1:  # every rank: the traced ones align their clocks here
            self.backend.collective.barrier()
        if self._recorder is not None:
            self._recorder.mark("sync")
            self._recorder.start()

    def close(self) -> Path | None:
        """Stop and write this rank's trace (once); the path, or None when not traced."""
        recorder, self._recorder = self._recorder, None
        if self.config is not None and self._steps and not self._closed:
            self._closed = True
            steps = f"{self._steps[0]}-{self._steps[-1]}"
            self.say(f"trace: steps {steps} of the traced ranks in {self.config.dir} (mtcore trace merge)")
        if recorder is None:
            return None
        recorder.stop()
        events, base_ns, used = [], 0, self._profiler is not None
        if used:
            self._profiler.stop()
            events, base_ns, extra = _exported(self._profiler)
        else:
            extra = {}
        self._profiler = None
        trace = {
            **extra,
            "traceEvents": events + chrome_events(recorder, os.getpid(), base_ns),
            "baseTimeNanoseconds": base_ns,
            "displayTimeUnit": "ms",
            TRACE_KEY: {
                "rank": self.rank,
                "world": self.world,
                "host": socket.gethostname(),
                "device": self.backend.device.type,
                "steps": self._steps,
                "sync_us": _us(recorder.marks["sync"], recorder, base_ns),
                # The same mark on perf_counter's clock: CLOCK_MONOTONIC on Linux, one
                # clock for every process of a host, so merge places a host's ranks exactly.
                "sync_clock_ns": recorder.marks["sync"],
                "clock": time.get_clock_info("perf_counter").implementation,
                "torch_profiler": used,
            },
        }
        path = trace_path(self.config.dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump(trace, f, default=str)
        return path


def _start_profiler(backend, memory: bool):
    """torch.profiler with the host's activity, and the device's where torch.profiler
    knows its type; None (the named ranges alone) where it cannot start here."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    kind = backend.device.type
    device_activity = getattr(torch.profiler.ProfilerActivity, kind.upper(), None)
    if kind != "cpu" and device_activity in torch.profiler.supported_activities():
        activities.append(device_activity)
    try:
        profiler = torch.profiler.profile(activities=activities, profile_memory=memory)
        profiler.start()
    except (RuntimeError, AssertionError) as e:
        note = f"torch.profiler cannot start here ({e}); tracing mtcore's phases alone"
        warnings.warn(note, stacklevel=2)
        return None
    return profiler


def _exported(profiler) -> tuple[list, int, dict]:
    """torch.profiler's Chrome trace: (its events, its base time in ns, its other keys)."""
    with tempfile.TemporaryDirectory(prefix="mtcore-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
    events = data.pop("traceEvents", [])
    base = int(data.pop("baseTimeNanoseconds", 0) or 0)
    data.pop("traceName", None)
    return events, base, data


def _us(ns: int, recorder: PhaseRecorder, base_ns: int) -> float:
    """A perf_counter_ns reading in the trace's microseconds (wall clock minus its base)."""
    return (ns + recorder.wall_offset_ns - base_ns) / 1e3


def chrome_events(recorder: PhaseRecorder, pid: int, base_ns: int) -> list[dict]:
    """The recorder's ranges, memory samples and marks as Trace Event Format events."""
    out: list[dict] = [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": PHASES_TID,
         "args": {"name": "mtcore phases"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": ASYNC_TID,
         "args": {"name": "mtcore in flight"}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": PHASES_TID,
         "args": {"sort_index": -2}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": ASYNC_TID,
         "args": {"sort_index": -1}},
    ]  # fmt: skip
    for e in recorder.events:
        out.append({
            "ph": "X", "cat": f"mtcore.{e.category}", "name": e.name, "pid": pid,
            "tid": ASYNC_TID if e.track == ASYNC else PHASES_TID,
            "ts": _us(e.start_ns, recorder, base_ns), "dur": (e.end_ns - e.start_ns) / 1e3,
            "args": {"category": e.category, **e.args},
        })  # fmt: skip
    name = f"{recorder.device.type} memory (bytes)"
    for ns, value in recorder.samples:
        out.append({"ph": "C", "name": name, "pid": pid, "ts": _us(ns, recorder, base_ns),
                    "args": {"bytes": value}})  # fmt: skip
    for mark, ns in recorder.marks.items():
        out.append({"ph": "i", "s": "p", "name": f"mtcore {mark}", "pid": pid,
                    "tid": PHASES_TID, "ts": _us(ns, recorder, base_ns)})  # fmt: skip
    return out
