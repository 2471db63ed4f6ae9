"""Launch parameters in threads, turned into ``num_warps`` for the active target's warp size.

``num_warps`` counts warps, and a warp is not 32 threads everywhere: Triton on MUSA
compiles with 128 threads per warp below arch 3.1. So each kernel states the
threads per program it wants (what its block-size comments reason about) and
:func:`num_warps` divides by the warp size of the target Triton compiles for
(``GPUTarget.warp_size``). On NVIDIA (32) this gives the warps the kernels always
used. Under Triton's CPU interpreter there is no target: 32 is assumed.

Nothing here imports triton at module import.
"""

from __future__ import annotations

import importlib
import os

INTERPRETER_WARP_SIZE = 32
# Triton's default num_warps (4) on a 32-wide warp: the kernels that never chose.
DEFAULT_THREADS = 128
# At most this many threads hold one row of a norm (16 warps of 32).
MAX_ROW_THREADS = 512
# Columns of a norm row per thread before another thread joins (256 per 32-wide warp).
ROW_COLUMNS_PER_THREAD = 8
# A 128x128 FP8 tile: 256 threads, 64 values each (8 warps of 32).
TILE_THREADS = 256

_WARP_SIZES: dict[object, int] = {}


def interpreting() -> bool:
    """Whether triton.jit runs kernels in its CPU interpreter (``TRITON_INTERPRET``)."""
    try:
        return bool(importlib.import_module("triton.knobs").runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 reads the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def warp_size() -> int:
    """Threads per warp of the target Triton compiles for on the current device."""
    if interpreting():
        return INTERPRETER_WARP_SIZE
    driver = importlib.import_module("triton.runtime").driver.active
    device = driver.get_current_device()
    size = _WARP_SIZES.get(device)
    if size is None:
        size = _WARP_SIZES[device] = int(driver.get_current_target().warp_size)
    return size


def num_warps(threads: int, warp: int | None = None) -> int:
    """Warps for ``threads`` threads per program: at least one whole warp.

    ``warp``: the warp size; the active target's when None.
    """
    warp = warp_size() if warp is None else warp
    if threads < 1 or warp < 1:
        raise ValueError(f"threads and warp size must be positive, got {threads} and {warp}")
    return max(threads // warp, 1)


def row_warps(block: int, warp: int | None = None) -> int:
    """Warps for a program that holds one ``block``-wide row in registers (the norms).

    ``ROW_COLUMNS_PER_THREAD`` columns per thread, from one warp up to
    ``MAX_ROW_THREADS`` threads: a 16384-wide row is then 32 float32 per thread for
    each live row tensor, whatever the warp size.
    """
    warp = warp_size() if warp is None else warp
    threads = min(max(block // ROW_COLUMNS_PER_THREAD, warp), max(MAX_ROW_THREADS, warp))
    return num_warps(threads, warp)
