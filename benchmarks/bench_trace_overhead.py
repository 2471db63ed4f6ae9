"""What mtcore's named trace ranges cost when no trace is recorded (and when one is).

    .venv/bin/python benchmarks/bench_trace_overhead.py [--rounds 15 --threads 1]

The trainer's ``Engine`` step (one process, the pipeline runner's no-pipelining schedule,
8 micro-batches of a small Llama-style GPT: a short step, so a fixed per-range cost
weighs more than in a real job) runs in three ways, in turn, step by step (load from
other processes falls on all alike; the per-round "paired" ratio is the figure least
moved by it):

* ``off``: as shipped, no trace recorded: every range is ``tracing.phase``'s shared null
  context;
* ``stubbed``: every module's ``tracing`` replaced by one whose ``phase``/``begin``/``end``
  return at once without looking at anything (the floor a range can cost short of
  deleting it from the source);
* ``phases``: a ``PhaseRecorder`` started (mtcore's ranges timed and kept, the device
  hook's ``record_function`` entered), torch.profiler not running.

It also prints the off path's cost per range (a loop of ``with tracing.phase(...)``
against an empty loop), the ranges in one step, and their product as a share of the
step: the bound on what the ranges cost when profiling is off.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types

import torch
from _loops import one_process_engine
from _timing import alternate, load_average, report

from mtcore.backend import select_backend, tracing
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.context import ring
from mtcore.parallel.data import ddp, zero3
from mtcore.parallel.moe import dispatch
from mtcore.parallel.pipeline import runner
from mtcore.training import engine as engine_module
from mtcore.training.config import OptimizerConfig

MODEL = GPTConfig(
    vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=128
)
OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5, max_grad_norm=1.0)
MICRO, MICROBATCHES = 2, 8
_NULL = contextlib.nullcontext()
STUB = types.SimpleNamespace(
    phase=lambda *a, **k: _NULL, begin=lambda *a, **k: None, end=lambda e: None,
    recording=lambda: False,
)  # fmt: skip


@contextlib.contextmanager
def stubbed():
    """Every module that opens ranges sees ``STUB`` instead of ``tracing``."""
    saved = [(m, m.tracing) for m in (runner, ddp, zero3, ring, dispatch)]
    saved_phase = engine_module.phase
    for module, _ in saved:
        module.tracing = STUB
    engine_module.phase = STUB.phase
    try:
        yield
    finally:
        for module, original in saved:
            module.tracing = original
        engine_module.phase = saved_phase


def per_range_ns(n: int = 200_000) -> tuple[float, float]:
    """(ns per off-path range, ns per iteration of the same loop without it)."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with tracing.phase("forward", "compute", microbatch=0, chunk=0):
            pass
    with_range = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return with_range, (time.perf_counter_ns() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load at start: {load_average()}")
    backend = select_backend("cpu")
    engine = one_process_engine(MODEL, backend, MICRO, MICROBATCHES, OPT)
    gen = torch.Generator().manual_seed(0)

    def batches():
        x = torch.randint(0, MODEL.vocab_size, (MICROBATCHES, MICRO, MODEL.seq_len + 1), generator=gen)
        return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in x]

    def off(step: int) -> float:
        return engine.train_step(batches()).loss

    def stub(step: int) -> float:
        with stubbed():
            return engine.train_step(batches()).loss

    recorder = tracing.PhaseRecorder(backend.device)

    def phases(step: int) -> float:
        recorder.events.clear()
        recorder.start()
        try:
            return engine.train_step(batches()).loss
        finally:
            recorder.stop()

    phases(0)
    ranges = len(recorder.events)
    timings = alternate({"off": off, "stubbed": stub, "phases": phases}, args.rounds, 1, args.warmup)
    report(timings, "off", MICROBATCHES * MICRO * MODEL.seq_len)
    on, bare = per_range_ns()
    step_s = statistics.median(timings.steps("off"))
    cost = ranges * (on - bare) * 1e-9
    print(
        f"off path: {on:.0f} ns per range ({bare:.0f} ns for the empty loop) x {ranges} ranges "
        f"per step = {cost * 1e6:.1f} us of a {step_s * 1e3:.1f} ms step: {cost / step_s:.5%}"
    )


if __name__ == "__main__":
    main()
