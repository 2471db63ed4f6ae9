"""Which path an FP8 GEMM should take where torch runs both: measured here, cached.

A backend declares the granularity pairs ``torch._scaled_mm`` runs on its device.
Running is not being fast: without FP8 arithmetic in the hardware, torch's CPU
``_scaled_mm`` is a scalar loop (43 s for one 2048x128x384 product against 0.08 s
for dequantize-and-multiply on an AVX-512 Xeon, torch 2.13), so declaring it
native made FP8 training on the CPU hundreds of times slower than its own
fallback. ``measured_paths`` is the ``choose`` of such a backend's ``FP8``: per
declared pair it times both paths and keeps the native one only where it is not
slower.

Per pair: both paths on a ``PROBE_SHAPE`` product (milliseconds even for a scalar
native loop); where the native path is more than ``CLEARLY_SLOWER`` times the
fallback's time there, the fallback is chosen. Otherwise both run on ``WORK_SHAPE``,
a product of the size training multiplies, and the faster one is chosen (native on a
tie: it rounds once). The answer depends on the machine and the torch build, so it is
cached per (torch version, machine) in ``cache_dir`` (the data cache,
``$MTCORE_DATA_CACHE`` or ``~/.cache/mtcore/data``), under a file lock: the ranks of a
job on one host measure once and agree. Delete the file to measure again.

``MTCORE_FP8_GEMM=native`` or ``=fallback`` overrides the measurement for every
declared pair (``measure``, the default, measures).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

import torch

from mtcore.backend.cache import default_cache_dir
from mtcore.backend.fp8 import (
    GemmPath,
    Quantized,
    fallback_scaled_matmul,
    native_scaled_matmul,
)
from mtcore.ops import fp8_quantize

GEMM_ENV = "MTCORE_FP8_GEMM"
GEMM_CHOICES = ("measure", "native", "fallback")
PROBE_SHAPE = (32, 32, 32)  # M, K, N
WORK_SHAPE = (512, 256, 256)
CLEARLY_SLOWER = 2.0
Pair = tuple[str, str]


def measured_paths(
    declared: Iterable[Pair],
    machine: str,
    cache_dir: Callable[[], Path] = default_cache_dir,
) -> dict[Pair, GemmPath]:
    """The path of each declared native pair on this host (see the module docstring).

    machine: what identifies the hardware (a CPU's model name and flags); with the torch
    version it keys the cache.
    """
    declared = sorted(declared)
    choice = os.environ.get(GEMM_ENV, "measure").strip().lower() or "measure"
    if choice not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={choice!r}: expected one of {', '.join(GEMM_CHOICES)}")
    if choice != "measure":
        return {pair: GemmPath(choice == "native", f"{GEMM_ENV}={choice}") for pair in declared}
    if not declared:
        return {}
    key = hashlib.sha256(f"{torch.__version__}\n{machine}".encode()).hexdigest()[:16]
    path = cache_dir() / f"fp8-gemm-paths-{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (held below)
    except OSError as exc:
        note = f"measured now for torch {torch.__version__}; not cached ({path.parent}: {exc.strerror})"
        return {pair: _with_note(_measure(pair), note) for pair in declared}
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)
        missing = [pair for pair in declared if _label(pair) not in cached]
        if missing:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            for pair in missing:
                measured = _measure(pair)
                cached[_label(pair)] = {"native": measured.native, "reason": measured.reason,
                                        "measured": stamp}  # fmt: skip
            _write(path, {"torch": torch.__version__, "machine": machine, "pairs": cached})
    when = min(cached[_label(pair)].get("measured", "?") for pair in declared)
    note = (
        f"measured {when} for torch {torch.__version__} on this host; {path} (delete to remeasure)"
    )
    return {
        pair: GemmPath(bool(cached[_label(pair)]["native"]), cached[_label(pair)]["reason"], note)
        for pair in declared
    }


def _measure(pair: Pair) -> GemmPath:
    native, fallback = _times(pair, PROBE_SHAPE)
    shape = PROBE_SHAPE
    if native <= CLEARLY_SLOWER * fallback:
        native, fallback = _times(pair, WORK_SHAPE)
        shape = WORK_SHAPE
    size = "x".join(map(str, shape))
    ms = f"{native * 1e3:.3g} vs {fallback * 1e3:.3g} ms"
    if native <= fallback:
        return GemmPath(
            True, f"torch._scaled_mm not slower than the fallback matmul at {size} ({ms})"
        )
    return GemmPath(
        False,
        f"torch._scaled_mm {native / fallback:.3g}x slower than the fallback matmul at {size} ({ms})",
    )


def _times(pair: Pair, shape: tuple[int, int, int]) -> tuple[float, float]:
    """Best-of seconds of one native and one fallback ``a @ b.T`` of ``shape``, float32 out."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = Quantized(
        *fp8_quantize(torch.randn(m, k, generator=g), torch.float8_e4m3fn, pair[0]), pair[0]
    )
    b = Quantized(
        *fp8_quantize(torch.randn(n, k, generator=g), torch.float8_e4m3fn, pair[1]), pair[1]
    )
    fallback = _best_of(lambda: fallback_scaled_matmul(a, b, torch.float32), reps=5)
    native = _best_of(lambda: native_scaled_matmul(a, b, torch.float32), reps=2)
    return native, fallback


def _best_of(run: Callable[[], object], reps: int) -> float:
    run()  # first call: allocation, dispatch caches
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _label(pair: Pair) -> str:
    return f"{pair[0]} x {pair[1]}"


def _with_note(path: GemmPath, note: str) -> GemmPath:
    return GemmPath(path.native, path.reason, note)


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        pairs = record["pairs"]
        if all(isinstance(v.get("native"), bool) and isinstance(v.get("reason"), str)
               for v in pairs.values()):  # fmt: skip
            return pairs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}  # absent or unreadable: measured again


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
