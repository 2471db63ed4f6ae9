"""C sources shipped with mtcore, compiled once per machine into cached shared libraries.

The host backend's own kernels are plain C (no torch headers: a second to compile)
called through ``ctypes``. They are built on first use with the system C compiler
(``$CC``, else ``cc``) for this CPU (``-march=native``) and kept in the cache
(``$MTCORE_DATA_CACHE/host-kernels``, else ``~/.cache/mtcore/data/host-kernels``),
keyed by the source, the compiler, its flags and the machine, so an edited source, a
new compiler or another CPU model builds anew. Ranks that build at once do not clash:
each compiles to a file of its own and renames it into place.

Without a working compiler the library is not available and the reference ops serve
(``mtcore doctor`` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from mtcore.backend.cache import default_cache_dir

COMPILER_ENV = "CC"
BASE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c99")
# x86 compilers use 256-bit vectors by default even where the CPU has 512-bit ones
X86_FLAGS = ("-mprefer-vector-width=512",)
BUILD_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """The C source could not be compiled or loaded here; the message says why."""


def library_dir() -> Path:
    return default_cache_dir() / "host-kernels"


def compiler_command() -> list[str]:
    """The compiler and flags a build uses on this machine."""
    compiler = os.environ.get(COMPILER_ENV, "").strip() or "cc"
    flags = BASE_FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else ())
    return [compiler, *flags]


def load_library(source: Path, machine: str) -> ctypes.CDLL:
    """``source`` compiled for ``machine`` (a description of this CPU), from the cache
    when it is there. Raises :class:`NativeBuildError` when it cannot be built or loaded."""
    command = compiler_command()
    if shutil.which(command[0]) is None:
        raise NativeBuildError(f"no C compiler: {command[0]!r} is not on PATH (set {COMPILER_ENV})")
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(command).encode(), machine.encode()]))
    target = library_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(source, command, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target}: {exc}") from exc


def _build(source: Path, command: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent, prefix=".build-")
    os.close(handle)
    try:
        result = subprocess.run(
            [*command, "-o", partial, str(source)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise NativeBuildError(
                f"{' '.join(command)} failed on {source.name}: "
                + (detail[0] if detail else f"exit {result.returncode}")
            )
        os.replace(partial, target)  # atomic: a rank building beside us sees a whole file
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"building {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
