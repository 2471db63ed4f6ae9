"""The check `mtcore train` makes of its backend before step 1: a fast part of the kit.

The conformance kit catches a lying kernel, but only when someone runs it. Before
training, each node checks the kernels its job will call that are not mtcore's
reference ops (the implementations the backend's plugins put first for the job's
dtype) against the reference, with the kit's own cases and tolerances
(``kernel_cases``), and the ranks check their collectives once (sums, gathers in
rank order, uneven sizes). A kernel 1% off, or an FP8 path that ignores its scales,
stops the job in one line naming the op and the plugin.

Kernel results are cached per machine: the key names the backend, its device, the
dtype, torch's and mtcore's versions, every selected implementation with its
plugin's version, and a digest of the code of the packages those implementations
come from (their ``.py``, ``.c`` and compiled files), so an edit to a plugin installed
with ``pip install -e`` is checked anew as a new release, device or torch is. Each
saved result carries a digest of itself and its key: an entry edited by hand (a
"passed" written in) is not trusted, the check runs again. ``mtcore doctor`` shows
the last results; ``training.self_check: false`` skips the check.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mtcore.backend.kernels import REFERENCE, KernelQuery

CACHE_ENV = "MTCORE_SELFCHECK_CACHE"


@dataclass
class SelfCheck:
    """One backend's kernel check: what was checked and what failed, with when and how long."""

    key: str
    backend: str
    dtype: str
    checked: list[str] = field(default_factory=list)  # "op (impl, plugin)"
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    when: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures


def cache_dir() -> Path:
    """Where results are kept: ``$MTCORE_SELFCHECK_CACHE``, else ``~/.cache/mtcore/selfcheck``."""
    given = os.environ.get(CACHE_ENV)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "mtcore" / "selfcheck"


def selected(backend, dtype: torch.dtype) -> list:
    """The implementations a job in ``dtype`` calls first that are not the reference ops."""
    table = backend.kernels.table(KernelQuery(backend.device.type, dtype))
    return [impls[0] for impls in table.values() if impls and impls[0].name != REFERENCE]


def key_of(backend, dtype: torch.dtype) -> str:
    """The cache key: what the result depends on (see the module docstring)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    import mtcore

    owners = packages_distributions()

    def release(module: str) -> str:
        names = owners.get(module.split(".")[0], [])
        try:
            return ",".join(f"{n}-{version(n)}" for n in names) or "?"
        except PackageNotFoundError:
            return "?"

    impls = sorted(
        (impl.op, impl.name, impl.plugin, release(_module(impl)), code_digest(_module(impl)))
        for impl in selected(backend, dtype)
    )
    capability = backend.device.capabilities()
    what = {
        "backend": backend.name,
        "device": capability.name,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "mtcore": mtcore.__version__,
        "impls": impls,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def _module(impl) -> str:
    return getattr(impl.fn, "__module__", "") or ""


# The files whose bytes can change what a kernel computes.
_CODE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".so", ".pyd")


@functools.cache
def code_digest(module: str) -> str:
    """A digest of the code of ``module``'s top-level package (every file of it that can
    change what its kernels compute), or of the module's own file when it is not in a
    package; "?" when neither can be found. Read once per process (a few ms for mtcore)."""
    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top) if top else None
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "?"
    if spec.submodule_search_locations:
        files = [
            path
            for root in spec.submodule_search_locations
            for path in Path(root).rglob("*")
            if path.suffix in _CODE_SUFFIXES and "__pycache__" not in path.parts
        ]
        base = None
    elif spec.origin and Path(spec.origin).is_file():
        files, base = [Path(spec.origin)], Path(spec.origin).parent
    else:
        return "?"
    digest = hashlib.sha256()
    for path in sorted(files):
        root = base or next(Path(r) for r in spec.submodule_search_locations if path.is_relative_to(r))
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"unreadable")
    return digest.hexdigest()[:16]


def _seal(key: str, fields: dict) -> str:
    """The digest a saved result carries of its key and contents."""
    body = json.dumps({"key": key, **fields}, sort_keys=True).encode()
    return hashlib.sha256(body).hexdigest()


def _load(path: Path, key: str | None = None) -> SelfCheck | None:
    """The result saved at ``path`` if it is intact (and for ``key`` when given)."""
    try:
        saved = json.loads(path.read_text())
        seal = saved.pop("seal")
        result = SelfCheck(**saved)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if seal != _seal(result.key, asdict(result)) or (key is not None and result.key != key):
        return None  # edited by hand, or a result for other code: not trusted
    return result


def check_kernels(backend, dtype: torch.dtype) -> SelfCheck:
    """Run the kit's cases for every selected non-reference implementation in ``dtype``."""
    from mtcore.backend.checks import kernel_cases as kit

    device = backend.torch_device()
    result = SelfCheck(key_of(backend, dtype), backend.name, kit.dtype_name(dtype))
    start = time.perf_counter()
    for impl in selected(backend, dtype):
        label = f"{impl.op} ({impl.name}, plugin {impl.plugin or '?'})"
        check = kit.SPECIAL_CHECKS.get(impl.op)
        if check is None and impl.op not in kit.CASES:
            continue  # no cases for it: the kit's own run reports that
        try:
            if check is not None:
                check(impl.fn, impl.fallback_ok, dtype, device)
            else:
                kit.check_op(impl.op, impl.fn, impl.fallback_ok, dtype, device)
        except AssertionError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "assertion failed"
            result.failures.append(f"{label}: {first}")
        except Exception as e:  # a kernel that raises on the kit's inputs fails the check too
            result.failures.append(f"{label}: raised {type(e).__name__}: {e}")
        result.checked.append(label)
    result.seconds = time.perf_counter() - start
    result.when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def cached_check(
    backend, dtype: torch.dtype, directory: Path | None = None
) -> tuple[SelfCheck, bool]:
    """``(result, from_cache)``: a cached result for this key, else a fresh check (saved)."""
    directory = directory or cache_dir()
    key = key_of(backend, dtype)
    path = directory / f"{backend.name}-{key}.json"
    saved = _load(path, key)
    if saved is not None:
        return saved, True
    result = check_kernels(backend, dtype)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fields = asdict(result)
        tmp.write_text(json.dumps({**fields, "seal": _seal(result.key, fields)}, indent=1))
        os.replace(tmp, path)
    except OSError:  # an unwritable cache: the check ran, it just runs again next time
        pass
    return result, False


def last_results(directory: Path | None = None) -> list[SelfCheck]:
    """Every intact cached result, newest first (for ``mtcore doctor``; an entry edited
    by hand is left out)."""
    directory = directory or cache_dir()
    found = []
    for path in sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        result = _load(path)
        if result is not None:
            found.append(result)
    return found


def check_collectives(collective, rank: int, world: int, device) -> list[str]:
    """A few collectives whose results every rank can predict; what came out wrong."""
    problems = []
    total = torch.tensor([float(rank + 1), 0.5], device=device)
    collective.all_reduce(total)
    want = [world * (world + 1) / 2, 0.5 * world]
    if total.tolist() != want:
        problems.append(f"all_reduce: {total.tolist()}, expected {want}")
    for size in (1, 1001):  # small, and not a multiple of any vector width
        mine = torch.full((size,), float(rank), device=device)
        every = torch.empty(world * size, device=device)
        collective.all_gather(every, mine)
        expected = torch.arange(world, dtype=torch.float32).repeat_interleave(size).to(device)
        if not torch.equal(every, expected):
            problems.append(f"all_gather of {size} per rank: not in rank order")
    return problems
