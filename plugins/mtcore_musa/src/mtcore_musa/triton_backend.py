"""Find the Triton backend that drives MUSA devices, whatever it is called.

Moore Threads' own Triton build names its backend ``mtgpu``; FlagTree names it
``mthreads``; other builds say ``musa``. The name is not a contract, but the target
is: a MUSA driver reports ``GPUTarget("musa", arch, warp_size)`` from
``get_current_target()`` (the same convention as "cuda" and "hip"). So every
registered backend whose driver is active is asked for its target.
"""

from __future__ import annotations

import importlib

MUSA_TARGET = "musa"


def musa_triton_backend() -> str | None:
    """The name under which ``triton.backends`` registered an active MUSA backend, or None.

    Imports triton on first call (seconds), so call it from diagnostics, never at plugin
    discovery. Any failure (no triton, a backend that cannot load its driver) means None.
    """
    try:
        backends = importlib.import_module("triton.backends").backends
    except Exception:
        return None
    for name, backend in dict(backends).items():
        try:
            driver = backend.driver
            if not driver.is_active():
                continue
            target = driver().get_current_target()
        except Exception:
            continue
        if getattr(target, "backend", None) == MUSA_TARGET:
            return name
    return None
