"""Run the Triton kernel pack on CPU tensors through Triton's interpreter.

``triton.jit`` decides between compiling and interpreting when a kernel is
decorated, i.e. when its module is imported, so the switch is set before any test
module imports triton: in tests/conftest.py (megatron-core imports triton too, from
test modules collected before this directory). ``test_runs_in_interpreter`` checks
that it took effect. It stays set for the rest of the session (and its
subprocesses): triton also reads it while an interpreted kernel runs.

Tests marked ``triton_interpreter`` run kernels and skip under a Triton older than
3.4 (torch 2.7.1 brings 3.3.1), whose interpreter cannot run the pack: scalar loads
come back as 1-element arrays ("only 0-dimensional arrays can be converted to Python
scalars"), float8 casts of -0.0 lose the sign, and after a compiled-mode launch its
``tl`` library functions raise "Cannot call @triton.jit'd outside of the scope of a
kernel". These are the interpreter's, not the compiled kernels' (docs/kernels.md).
"""

from __future__ import annotations

from importlib import metadata

import pytest
from packaging.version import Version

INTERPRETER_FROM = Version("3.4")


def _triton_version() -> Version | None:
    try:
        return Version(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "triton_interpreter: runs pack kernels in Triton's CPU interpreter"
    )


def pytest_collection_modifyitems(config, items):
    found = _triton_version()
    if found is None or found >= INTERPRETER_FROM:
        return
    skip = pytest.mark.skip(
        reason=f"triton {found}'s interpreter cannot run the pack (needs >= {INTERPRETER_FROM})"
    )
    for item in items:
        if item.get_closest_marker("triton_interpreter"):
            item.add_marker(skip)
