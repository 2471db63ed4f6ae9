"""The check `mtcore train` makes of its backend before step 1: a fast part of the kit.

The conformance kit catches a lying kernel, but only when someone runs it. Before
training, each node checks the kernels its job will call that are not mtcore's
reference ops (the implementations the backend's plugins put first for the job's
dtype) against the reference, with the kit's own cases and tolerances
(``kernel_cases``) plus the job's own sizes (``KernelUse``: attention at the job's
sequence length), times each against the reference (``kernel_timing``), and, for an
FP8 job, checks the backend's quantize and scaled matmul for the recipe's GEMMs
(``job_fp8``). The ranks check the collectives of their groups
(``job_collectives``). A kernel 1% off, or an FP8 path that ignores or rounds its
scales, stops the job in one line naming the op and the plugin.

Kernel results are cached per machine: the key names the backend, its device, the
dtype, the job's sizes and FP8 recipe, torch's and mtcore's versions, every selected
implementation with its plugin's version, and a digest of the code of the packages
those implementations (and the FP8 interface) come from (their ``.py``, ``.c`` and
compiled files), so an edit to a plugin installed with ``pip install -e`` is checked
anew as a new release, device or torch is. A result whose only failures are timings
is not kept (a busy machine must not fail the next run too). Collective results are
saved beside them for ``mtcore doctor`` (they run every time: all ranks must take
part). Each saved result carries a digest of itself and its key: an entry edited by
hand (a "passed" written in) is not trusted, the check runs again and doctor leaves
it out. ``training.self_check: false`` skips the check.
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
    """One backend's check: what was checked and what failed, with when and how long.
    ``kind``: "kernels" (a node's kernels and FP8) or "collectives" (the job's groups)."""

    key: str
    backend: str
    dtype: str
    checked: list[str] = field(default_factory=list)  # "op (impl, plugin)", "tp: ..."
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    when: str = ""
    kind: str = "kernels"

    # Set by check_kernels (not a field: never saved): every failure is a timing.
    timing_only = False

    @property
    def passed(self) -> bool:
        return not self.failures


def cache_dir() -> Path:
    """Where results are kept: ``$MTCORE_SELFCHECK_CACHE``, else ``~/.cache/mtcore/selfcheck``."""
    given = os.environ.get(CACHE_ENV)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "mtcore" / "selfcheck"


@dataclass(frozen=True)
class KernelUse:
    """What a job asks of its kernels beyond the kit's cases: its sequence length (an
    attention case at it, up to ``MAX_SEQ_LEN``), and for an FP8 job the recipe's GEMMs
    (``job_fp8.FP8Gemm``), the dtypes their products go to, and delayed scaling."""

    seq_len: int | None = None
    fp8_gemms: tuple = ()
    fp8_out_dtypes: tuple[torch.dtype, ...] = ()
    fp8_delayed: bool = False

    def describe(self) -> str:
        gemms = [(g.name, str(g.a), str(g.b)) for g in self.fp8_gemms]
        return json.dumps(
            [self.seq_len, gemms, [str(d) for d in self.fp8_out_dtypes], self.fp8_delayed]
        )


# The longest attention case the self-check adds (the float64 reference it is compared
# with costs O(seq**2); 256 adds about 0.1-0.2 s to a bf16 check on a CPU).
MAX_SEQ_LEN = 256


def selected(backend, dtype: torch.dtype) -> list:
    """The implementations a job in ``dtype`` calls first that are not the reference ops."""
    table = backend.kernels.table(KernelQuery(backend.device.type, dtype))
    return [impls[0] for impls in table.values() if impls and impls[0].name != REFERENCE]


def key_of(backend, dtype: torch.dtype, use: KernelUse = KernelUse()) -> str:
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
        "use": use.describe(),
    }
    if use.fp8_gemms:  # the FP8 interface's code: a plugin may override quantize or matmul
        module = type(backend.fp8).__module__
        what["fp8"] = [module, release(module), code_digest(module)]
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
        root = base or next(
            Path(r) for r in spec.submodule_search_locations if path.is_relative_to(r)
        )
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


def check_kernels(backend, dtype: torch.dtype, use: KernelUse = KernelUse()) -> SelfCheck:
    """Run the kit's cases (and the job's) for every selected non-reference implementation
    in ``dtype``, time each against the reference, and check the job's FP8 path."""
    from mtcore.backend.checks import kernel_cases as kit
    from mtcore.backend.checks import kernel_timing

    device = backend.torch_device()
    result = SelfCheck(key_of(backend, dtype, use), backend.name, kit.dtype_name(dtype))
    start = time.perf_counter()
    slow: list[str] = []
    for impl in selected(backend, dtype):
        label = f"{impl.op} ({impl.name}, plugin {impl.plugin or '?'})"
        check = kit.SPECIAL_CHECKS.get(impl.op)
        if check is None and impl.op not in kit.CASES:
            continue  # no cases for it: the kit's own run reports that
        result.checked.append(label)
        try:
            if check is not None:
                check(impl.fn, impl.fallback_ok, dtype, device)
            else:
                extra = _extra(impl.op, use)
                kit.check_op(impl.op, impl.fn, impl.fallback_ok, dtype, device, extra)
        except AssertionError as e:
            result.failures.append(f"{label}: {_first_line(e)}")
            continue
        except Exception as e:  # a kernel that raises on the kit's inputs fails the check too
            result.failures.append(f"{label}: raised {type(e).__name__}: {e}")
            continue
        inputs = kernel_timing.speed_inputs(impl.op, dtype, device)
        try:
            if inputs is not None:
                sync = backend.device.synchronize
                kernel_timing.check_speed(impl.op, impl.fn, impl.fallback_ok, inputs, sync)
        except AssertionError as e:
            slow.append(f"{label}: {_first_line(e)}")
    if use.fp8_gemms:
        from mtcore.backend.checks.job_fp8 import check_fp8

        fp8 = backend.fp8
        result.checked.append(f"FP8 quantize and scaled_matmul ({type(fp8).__module__})")
        gemms, outs = list(use.fp8_gemms), use.fp8_out_dtypes
        result.failures += check_fp8(fp8, gemms, outs, use.fp8_delayed, device)
    result.timing_only = bool(slow) and not result.failures
    result.failures += slow
    result.seconds = time.perf_counter() - start
    result.when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def _extra(op: str, use: KernelUse) -> list:
    """The job's own cases for ``op``: attention at its sequence length when the kit's
    cases are shorter."""
    from mtcore.backend.checks import kernel_cases as kit

    if op in ("attention", "attention_lse") and use.seq_len and use.seq_len > 130:
        return [kit.job_attention_case(min(use.seq_len, MAX_SEQ_LEN))]
    return []


def _first_line(e: AssertionError) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else "assertion failed"


def save(result: SelfCheck, directory: Path | None = None) -> None:
    """Write ``result`` sealed (see ``_seal``) where ``last_results`` finds it."""
    directory = directory or cache_dir()
    path = directory / f"{result.backend}-{result.kind}-{result.key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fields = asdict(result)
        tmp.write_text(json.dumps({**fields, "seal": _seal(result.key, fields)}, indent=1))
        os.replace(tmp, path)
    except OSError:  # an unwritable cache: the check ran, it just runs again next time
        pass


def cached_check(
    backend, dtype: torch.dtype, directory: Path | None = None, use: KernelUse = KernelUse()
) -> tuple[SelfCheck, bool]:
    """``(result, from_cache)``: a cached result for this key, else a fresh check (saved,
    unless its only failures are timings: those are measured again next time)."""
    directory = directory or cache_dir()
    key = key_of(backend, dtype, use)
    saved = _load(directory / f"{backend.name}-kernels-{key}.json", key)
    if saved is not None:
        return saved, True
    result = check_kernels(backend, dtype, use)
    if not result.timing_only:
        save(result, directory)
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
