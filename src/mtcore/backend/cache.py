"""Where the backend keeps what it measures once per machine (FP8 GEMM paths)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """The data cache: ``$MTCORE_DATA_CACHE``, else ``~/.cache/mtcore/data``.

    The same rule as ``mtcore.data.default_cache_dir`` (the data layer imports nothing
    from mtcore, the backend nothing from it), so one variable moves every cache of a
    user; tests/unit/backend/test_fp8_paths.py checks that the two agree."""
    env = os.environ.get("MTCORE_DATA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtcore" / "data"
