"""Named ranges around mtcore's phases, recorded only while a trace is being taken.

The pipeline runner (each action), the engine (each phase of a step), the data-parallel
buckets, ZeRO-3's gathers, the cp ring and MoE's all-to-alls open
``phase(name, category, **args)`` around their work; the models never do. With no trace
being recorded ``phase`` returns one shared null context (one global read and a call:
benchmarks/bench_trace_overhead.py measures it against no ranges at all). While a
``PhaseRecorder`` is started, each range is timed on the host's clock and also handed to
the device's range hook (``Device.trace_range``, by default torch.profiler's
``record_function``): a backend whose device torch.profiler cannot see still gets the
named wall-clock ranges, and one with range markers of its own adds them.

Categories (what ``mtcore trace merge`` sums per rank, as the planner predicts them):
``compute``, ``comm`` (a collective or transfer the rank waits for: exposed), ``bubble``
(waiting for a pipeline peer's message), ``optimizer``, ``data``, and ``step`` (the
window of one training step, whose own time outside every range is "other").
``begin``/``end`` time an asynchronous operation (a bucket's reduction from its launch to
its completion) on a track of its own: it may overlap the compute and is not exposed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

CATEGORIES = ("compute", "comm", "bubble", "optimizer", "data", "step")
MAIN, ASYNC = "phases", "async"  # the tracks: the rank's phases, its operations in flight

_OFF = contextlib.nullcontext()


@dataclass
class PhaseEvent:
    """One range: ``start_ns``/``end_ns`` on ``time.perf_counter_ns``'s clock."""

    name: str
    category: str
    start_ns: int
    end_ns: int
    track: str = MAIN
    args: dict = field(default_factory=dict)


class PhaseRecorder:
    """Collects this process's ranges between ``start`` and ``stop``; ``memory``: a reading
    of the device's memory (``Device.memory_allocated``: the resident set on the host) at
    every range's end, a counter over time and the peak per phase."""

    def __init__(self, device, memory: bool = False):
        self.device, self.memory = device, memory
        self.events: list[PhaseEvent] = []
        self.samples: list[tuple[int, int]] = []  # (perf_counter_ns, bytes)
        self.marks: dict[str, int] = {}  # instants by name (the clock-alignment barrier)
        # perf_counter_ns + offset = the wall clock (ns since the epoch), which is
        # what torch.profiler's Chrome traces count from (their baseTimeNanoseconds)
        self.wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._thread = threading.get_ident()

    def start(self) -> None:
        global _active
        _active = self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter_ns()

    def sample(self, now_ns: int) -> int:
        value = int(self.device.memory_allocated())
        self.samples.append((now_ns, value))
        return value


_active: PhaseRecorder | None = None


class _Range:
    __slots__ = ("args", "category", "inner", "name", "recorder", "start")

    def __init__(self, recorder: PhaseRecorder, name: str, category: str, args: dict):
        self.recorder, self.name, self.category, self.args = recorder, name, category, args

    def __enter__(self):
        if "microbatch" in self.args:  # "forward mb3 c0": readable in the timeline
            self.name = f"{self.name} mb{self.args['microbatch']} c{self.args.get('chunk', 0)}"
        self.inner = self.recorder.device.trace_range(self.name)
        self.inner.__enter__()
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        end = time.perf_counter_ns()
        self.inner.__exit__(*exc)
        rec = self.recorder
        if rec.memory:
            self.args["memory_bytes"] = rec.sample(end)
        rec.events.append(PhaseEvent(self.name, self.category, self.start, end, MAIN, self.args))
        return False


def phase(name: str, category: str = "compute", **args):
    """A context manager around one phase (a null one unless a trace is being recorded).
    ``args`` (micro-batch, chunk, bucket, ...) go into the trace event. Ranges opened on
    another thread than the recorder's (a gloo or checkpoint worker) are left out: the
    phases track is this rank's main thread."""
    recorder = _active
    if recorder is None or threading.get_ident() != recorder._thread:
        return _OFF
    return _Range(recorder, name, category, args)


def recording() -> bool:
    """Whether a trace is being recorded now (to skip work done only for one)."""
    return _active is not None


def begin(name: str, category: str = "comm", **args) -> PhaseEvent | None:
    """The start of an asynchronous operation (None when not recording); ``end`` it once
    it has completed. Shown on the rank's track of operations in flight."""
    recorder = _active
    if recorder is None:
        return None
    now = time.perf_counter_ns()
    return PhaseEvent(name, category, now, now, ASYNC, args)


def end(event: PhaseEvent | None) -> None:
    recorder = _active
    if event is None or recorder is None:
        return
    event.end_ns = time.perf_counter_ns()
    recorder.events.append(event)
