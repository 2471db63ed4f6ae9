"""Measure layouts with ``mtcore train`` and set the plan's prediction beside each.

Each layout runs as its own job of ``mtcore.train`` ranks (a fresh process group, a
few steps, no checkpoint or tensorboard); the trainer's log lines give the step time
(median after the first step, which pays warm-up). The memory is each rank's peak of
the bytes torch's allocator holds for tensors, what the plan predicts: every rank
runs under ``python -m mtcore.plan.sweep``, which trains it with torch's profiler
recording allocations (``profile_memory``) and writes that peak to a file when the rank
ends (``PEAKS_DIR_ENV``).

Why not the trainer's own ``mem`` column: on the host backend it is the process's
peak resident set, which holds torch and its math libraries (~350 MB before a model
exists) and whatever glibc keeps after a free; subtracting the resident set seen
before the model is built still reads 2.5x the tensors of a 200 MB rank, and glibc's
``mallinfo2`` counts the data pipeline and math libraries too, with no peak of its
own (docs/plan.md). The profiler records every op and keeps its events to the end:
within a short run's noise, not something for every training run, so it lives here
and not in the host device.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from mtcore.plan.layouts import layout_overrides

_STEP = re.compile(r"step (\d+)/\d+ \|.*\| mem ([\d.]+) (B|KiB|MiB|GiB) \| ([\d.]+) s/step")
PEAKS_DIR_ENV = "MTCORE_SWEEP_PEAKS_DIR"
"""Where each rank under ``rank_main`` writes its tensor peak (a file ``rank<N>``): four
ranks' stderr lines interleave, a file per rank does not."""
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
QUIET = [
    "--checkpoint.dir", "null", "--logging.tensorboard_dir", "null", "--logging.interval", "1",
    "--logging.progress", "lines", "--training.sample_tokens", "0",
    "--training.eval_batches", "1",
]  # fmt: skip


@dataclass
class Measured:
    """One layout's run: ``peak_bytes`` is the largest rank's tensor peak, ``rank_peaks``
    every rank's (by global rank), ``resident_bytes`` the trainer's logged ``mem``."""

    layout: str
    step_s: float | None
    peak_bytes: float | None
    error: str = ""
    rank_peaks: dict[int, int] = field(default_factory=dict)
    resident_bytes: float | None = None
    trace: str | None = None  # with ``trace_to``: the merged trace of its last step


def parse_log(text: str) -> tuple[float | None, float | None]:
    """(median seconds per step after the first, the largest reported peak memory)."""
    steps = [(int(m[0]), float(m[1]) * _UNITS[m[2]], float(m[3])) for m in _STEP.findall(text)]
    if not steps:
        return None, None
    times = [s for i, _, s in steps if i > 1] or [steps[-1][2]]
    return statistics.median(times), max(mem for _, mem, _ in steps)


def read_rank_peaks(folder: str) -> dict[int, int]:
    """``{global rank: tensor peak bytes}`` from the files ``rank_main`` wrote in ``folder``."""
    peaks = {}
    for name in os.listdir(folder):
        if name.startswith("rank") and name[4:].isdigit():
            with open(os.path.join(folder, name)) as f:
                peaks[int(name[4:])] = int(f.read().strip())
    return peaks


def stage_of(rank: int, world: int, pp: int) -> int:
    """The pipeline stage of global ``rank``: ranks are ordered tp-cp-dp-pp (pp slowest)."""
    return rank // (world // pp)


def measure(
    config: str | None,
    layout: str,
    nproc: int,
    steps: int,
    overrides: list[str],
    trace_to: str | None = None,
) -> Measured:
    """Train ``layout`` for ``steps`` steps on ``nproc`` local ranks, each under
    ``rank_main``, through torch's elastic launcher, each rank a new interpreter (so
    each one's peak memory is its own: `mtcore train` forks its ranks from a server whose
    pages they share), after preparing the data here once (as ``mtcore train`` does: ranks that each found
    an untokenized corpus would all build its cache at once).

    ``trace_to``: a file where the ranks' traces of the last step, merged (``mtcore trace
    merge``'s timeline), go. The ranks record mtcore's named phases alone
    (``logging.profile.torch_profiler: false``): a second torch.profiler would stop the one
    that records the tensor peak, and the phases are what the categories are made of."""
    run = [*overrides, *layout_overrides(layout), *QUIET]
    run += ["--training.steps", str(steps), "--training.eval_interval", str(steps + 1)]
    problem = prepare_data(config, run, nproc)
    if problem:
        return Measured(layout, None, None, problem)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args += [f"--nproc-per-node={nproc}", "-m", "mtcore.plan.sweep", *([config] if config else [])]
    with tempfile.TemporaryDirectory(prefix="mtcore-sweep-") as folder:
        traces = os.path.join(folder, "traces")
        if trace_to:
            run += ["--logging.profile.steps", f"[{steps}, {steps}]", "--logging.profile.dir",
                    traces, "--logging.profile.torch_profiler", "false"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env[PEAKS_DIR_ENV] = folder
        done = subprocess.run([*args, *run], capture_output=True, text=True, env=env)
        peaks = read_rank_peaks(folder)
        merged = _merge_traces(traces, trace_to) if trace_to and done.returncode == 0 else ""
    text = done.stdout + done.stderr
    step_s, resident = parse_log(text)
    peak = max(peaks.values()) if peaks else None
    measured = Measured(layout, step_s, peak, rank_peaks=peaks, resident_bytes=resident)
    if done.returncode != 0 or step_s is None or len(peaks) != nproc:
        lines = [ln for ln in done.stderr.strip().splitlines() if "USDT" not in ln]
        measured.error = f"exit {done.returncode}: {(lines or ['no output'])[-1]}"
    elif merged.startswith("trace: "):
        measured.error = merged
    elif trace_to:
        measured.trace = merged
    return measured


def _merge_traces(traces: str, path: str) -> str:
    """The ranks' traces in ``traces`` merged into one timeline at ``path``; ``path``, or
    "trace: " and what was wrong."""
    from mtcore.plan.trace import save
    from mtcore.training.trace_merge import TraceError, load, merge, trace_files

    try:
        save(merge([load(file) for file in trace_files(traces)]), path)
    except TraceError as e:
        return f"trace: {e}"
    return path


def prepare_data(config: str | None, overrides: list[str], nproc: int) -> str:
    """Build (or find cached) the job's tokenizer and token index; the problem, or ""."""
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config
    from mtcore.training.trainer import prepare

    try:
        prepare(load_config(config, overrides), nproc)
    except ConfigError as e:
        return f"bad input: {e}"
    return ""


def as_trained(config, nproc: int):
    """``config`` with the model the trainer builds from it on ``nproc`` ranks:
    ``model.vocab_size`` its tokenizer's (built, or found cached), padded as the trainer
    pads it. ``data.vocab_size``, which ``mtcore plan`` goes by, is the size a tokenizer is
    trained *to*; a small corpus gives fewer (configs/llava.yaml's captions: 331 of 4096),
    and a prediction set beside a measurement must be of the model that ran. Raises
    ``ConfigError`` as the trainer does."""
    from mtcore.training.trainer import prepare

    return config.model_copy(update={"model": prepare(config, nproc).model})


def compare(config_path, layout, nproc, steps, overrides, hardware):
    """(what ``layout`` measures here, the plan's prediction for it on ``hardware``)."""
    from mtcore.plan.planner import plan
    from mtcore.training.overrides import load_config

    config = as_trained(load_config(config_path, [*overrides, *layout_overrides(layout)]), nproc)
    predicted = plan(config, nproc, shared_host(hardware, nproc)[0], options_here(config))
    return measure(config_path, layout, nproc, steps, overrides), predicted


def shared_host(hardware, nproc: int, cores: int | None = None):
    """(``hardware`` as ``nproc`` ranks on this host's ``cores`` see it, a line saying so
    or None): with more ranks than cores, each rank gets ``cores / nproc`` of a core's
    compute and memory bandwidth (its peaks and ``memory_bandwidth_gbs`` scaled; a
    GEMM-shape table's fractions stay). The planner's accelerators run side by side;
    ranks time-sharing cores do not."""
    from dataclasses import replace

    cores = cores or len(os.sched_getaffinity(0))
    if nproc <= cores:
        return hardware, None
    share = cores / nproc
    peaks = {dtype: tflops * share for dtype, tflops in hardware.peak_tflops.items()}
    shared = replace(
        hardware,
        peak_tflops=peaks,
        memory_bandwidth_gbs=hardware.memory_bandwidth_gbs * share,
        matmul_tflops=None if hardware.matmul_tflops is None else hardware.matmul_tflops * share,
    )
    line = (
        f"{nproc} ranks on {cores} cores: each planned with {cores}/{nproc} of a core's "
        "compute and memory bandwidth"
    )
    return shared, line


def options_here(config):
    """Planner ``Options`` for what this machine's backend runs: a fused attention
    (a log-sum-exp per query kept, no score matrix) unless the reference serves it; and
    any tp group allowed, since every rank of a sweep runs on this one host."""
    import torch

    from mtcore.backend import select_backend
    from mtcore.backend.kernels import REFERENCE, KernelQuery
    from mtcore.plan.planner import Options

    with warnings.catch_warnings():  # the choice of backend is the trainer's to say
        warnings.simplefilter("ignore")
        backend = select_backend(config.training.backend)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    query = KernelQuery(backend.device.type, dtype[config.precision.dtype])
    attention = backend.kernels.table(query)["attention"][0]
    return Options(fused_attention=attention.name != REFERENCE, cross_node=True)


@contextlib.contextmanager
def tensor_peak() -> Iterator[list[int]]:
    """Record this thread's tensor allocations; on exit the yielded list holds the peak
    of bytes allocated (since entry) and still alive, as torch's CPU allocator hands
    them out (``live_peak``).

    The profiler's ``profile_memory`` reports every allocation and free made on this
    thread, with its address and size. A free made on another thread (gloo's, which
    drops the last reference to a tensor a collective held) is not reported, so the
    profiler's own running total only grows with it; ``live_peak`` instead ends such a
    block when the allocator hands its addresses out again.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    out: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            f = node.extra_fields
            events.append((node.start_time_ns, f.total_allocated, f.ptr, f.alloc_size))
    out.append(live_peak(_in_order(events)))


def _in_order(events: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """``(address, size)`` (negative: a free) in the order they happened: by time, and
    within one clock tick in the order their running totals chain."""
    events.sort(key=lambda ev: ev[0])
    ordered: list[tuple[int, int]] = []
    total, i = 0, 0
    while i < len(events):
        j = i
        while j < len(events) and events[j][0] == events[i][0]:
            j += 1
        tick = events[i:j]
        while tick:
            k = next((k for k, ev in enumerate(tick) if ev[1] - ev[3] == total), 0)
            _, total, ptr, size = tick.pop(k)
            ordered.append((ptr, size))
        i = j
    return ordered


def live_peak(events: list[tuple[int, int]]) -> int:
    """The largest sum of live blocks over ``(address, size)`` events (a negative size
    frees the block at that address). A block is live from its allocation until its
    free, or until a later allocation overlaps its addresses (which proves it freed)."""
    starts: list[int] = []  # live blocks' addresses, sorted
    sizes: dict[int, int] = {}
    live = peak = 0
    for ptr, size in events:
        if size <= 0:
            if ptr in sizes:
                live -= sizes.pop(ptr)
                starts.pop(bisect.bisect_left(starts, ptr))
            continue
        i = max(0, bisect.bisect_right(starts, ptr) - 1)
        while i < len(starts) and starts[i] < ptr + size:
            if starts[i] + sizes[starts[i]] > ptr:  # overlaps: that block was freed unseen
                live -= sizes.pop(starts.pop(i))
            else:
                i += 1
        bisect.insort(starts, ptr)
        sizes[ptr] = size
        live += size
        peak = max(peak, live)
    return peak


def rank_main(argv: list[str]) -> int:
    """One rank of ``mtcore.train`` (same arguments), its tensor peak said at the end."""
    from mtcore.train import main

    with tensor_peak() as peak:
        code = main(argv)
    rank = os.environ.get("RANK", "0")
    folder = os.environ.get(PEAKS_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"rank{rank}"), "w") as f:
            f.write(f"{peak[0]}\n")
    else:
        print(f"sweep: rank {rank} tensor peak {peak[0]} bytes", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
