"""Accelerator descriptions: published specs as data files, one TOML file per accelerator.

The shipped files live in ``mtcore/plan/hardware/`` and name the source of each
number (or say it is an estimate) in their ``[sources]`` table. A user adds an
accelerator by writing a file of the same shape and passing its path
(``mtcore plan --hardware my.toml``). A shipped file is found by its name, its file
name or one of its ``aliases`` (``h100`` for ``H100-SXM``), whatever the case and
punctuation (``find_description``). Bandwidths are per accelerator and per
direction, in GB/s (1e9 bytes); peaks are dense (no structured sparsity) TFLOP/s.

A running backend's capability table (``Device.capabilities()``, what ``mtcore
doctor`` prints) fills in what it knows over a description: ``fill_from_backend``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import tomllib

HARDWARE_DIR = Path(__file__).parent / "hardware"
_REQUIRED = (
    "name",
    "memory_gb",
    "memory_bandwidth_gbs",
    "gpus_per_node",
    "intra_node_gbs",
    "inter_node_gbs",
    "peak_tflops",
)


class HardwareError(ValueError):
    """A hardware description that cannot be found or read; the message names the file."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links around it (what the planner needs, nothing more).

    The network is a hierarchy: ``gpus_per_node`` accelerators on the intra-node link,
    nodes on the network (``inter_node_gbs`` per accelerator's port), and, when
    ``nodes_per_pod`` is given, pods of that many nodes joined by a slower (oversubscribed)
    layer, ``inter_pod_gbs`` per accelerator (``mtcore.plan.network`` prices each
    collective kind on it). ``gemm_efficiency``: per dtype, a measured table of matrix
    product shapes (``"MxKxN"``) to the achieved fraction of that dtype's peak
    (``mtcore.plan.gemm``)."""

    name: str
    memory_gb: float
    memory_bandwidth_gbs: float
    gpus_per_node: int
    intra_node_gbs: float
    inter_node_gbs: float
    peak_tflops: dict[str, float]
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    nodes_per_pod: int | None = None
    inter_pod_gbs: float | None = None
    inter_pod_latency_us: float | None = None
    fused_attention: bool = True
    matmul_tflops: float | None = None  # measured max achievable dense bf16 matmul, if published
    # the training software's fixed costs, beyond the work: each micro-batch's forward or
    # backward through a chunk (launches, the engine's bookkeeping), and each pipeline send
    microbatch_overhead_us: float = 0.0
    p2p_overhead_us: float = 0.0
    gemm_efficiency: dict[str, dict[str, float]] | None = None
    sources: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names a user may give for a shipped file (h100)
    path: str = ""

    def __post_init__(self):
        check_fields(self)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def pod_size(self) -> int | None:
        """Accelerators in one pod (None: no level above the nodes)."""
        return self.gpus_per_node * self.nodes_per_pod if self.nodes_per_pod else None

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for matrix products in ``dtype`` (bf16, fp16, fp32, fp8)."""
        if dtype not in self.peak_tflops:
            known = ", ".join(sorted(self.peak_tflops))
            raise HardwareError(f"{self.name} gives no peak for {dtype} (it has: {known})")
        return self.peak_tflops[dtype] * 1e12


_POSITIVE = ("memory_gb", "memory_bandwidth_gbs", "intra_node_gbs", "inter_node_gbs")
_OPTIONAL_POSITIVE = ("matmul_tflops", "inter_pod_gbs")
_LATENCIES = ("intra_node_latency_us", "inter_node_latency_us", "inter_pod_latency_us")
_LATENCIES += ("microbatch_overhead_us", "p2p_overhead_us")
_COUNTS = ("gpus_per_node", "nodes_per_pod")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_fields(hardware: Hardware) -> None:
    """Raise ``TypeError`` naming the first field that is not of its kind: bandwidths,
    memory, peaks and GEMM fractions finite and positive (fractions at most 1),
    latencies finite and not negative, ``gpus_per_node`` / ``nodes_per_pod`` whole
    numbers of at least 1, ``fused_attention`` a boolean, ``name``, aliases and sources
    text."""
    numbers = {k: getattr(hardware, k) for k in _POSITIVE}
    numbers |= {
        k: getattr(hardware, k) for k in _OPTIONAL_POSITIVE if getattr(hardware, k) is not None
    }
    if not isinstance(hardware.peak_tflops, dict) or not hardware.peak_tflops:
        raise TypeError("peak_tflops must be a table of dtype = TFLOP/s")
    numbers |= {f"peak_tflops.{k}": v for k, v in hardware.peak_tflops.items()}
    for key, value in numbers.items():
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise TypeError(f"{key} must be a finite positive number, not {value!r}")
    for key in _LATENCIES:
        value = getattr(hardware, key)
        if value is not None and (not _is_number(value) or not math.isfinite(value) or value < 0):
            raise TypeError(f"{key} must be a finite number of microseconds >= 0, not {value!r}")
    for key in _COUNTS:
        value = getattr(hardware, key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise TypeError(f"{key} must be a whole number >= 1, not {value!r}")
    if (hardware.nodes_per_pod is None) != (hardware.inter_pod_gbs is None):
        raise TypeError("nodes_per_pod and inter_pod_gbs go together (a pod level needs both)")
    if not isinstance(hardware.fused_attention, bool):
        raise TypeError(f"fused_attention must be true or false, not {hardware.fused_attention!r}")
    if not isinstance(hardware.name, str) or not hardware.name:
        raise TypeError(f"name must be text, not {hardware.name!r}")
    if not isinstance(hardware.aliases, (list, tuple)) or not all(
        isinstance(alias, str) and _key(alias) for alias in hardware.aliases
    ):
        raise TypeError(f"aliases must be a list of names, not {hardware.aliases!r}")
    if not isinstance(hardware.sources, dict) or not all(
        isinstance(v, str) for v in hardware.sources.values()
    ):
        raise TypeError("sources must be a table of text")
    from mtcore.plan.gemm import check_table

    if hardware.gemm_efficiency is not None:
        check_table(hardware.gemm_efficiency, hardware.peak_tflops)


def builtin_descriptions() -> list[Hardware]:
    """The shipped descriptions, by name."""
    return sorted((_read(path) for path in HARDWARE_DIR.glob("*.toml")), key=lambda hw: hw.name)


def builtin_names() -> list[str]:
    """The shipped descriptions' names (``A100-80GB``, ``H100-SXM``, ...)."""
    return [hardware.name for hardware in builtin_descriptions()]


def describe_names(descriptions: list[Hardware] | None = None) -> str:
    """``A100-80GB (a100, ...), B200, ...``: each name with its aliases, for help and errors."""
    return ", ".join(
        f"{hw.name} ({', '.join(hw.aliases)})" if hw.aliases else hw.name
        for hw in descriptions or builtin_descriptions()
    )


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped description by name or alias (``find_description``) or a TOML file by path."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise HardwareError(f"hardware file not found: {path}")
        return _read(path)
    return find_description(name_or_path, builtin_descriptions())


def find_description(query: str, descriptions: list[Hardware]) -> Hardware:
    """The one description whose name, file name or alias is ``query``, compared without
    case or punctuation (``h100``, ``H100 SXM`` and ``h100-sxm`` name ``H100-SXM``). A
    query that several descriptions claim is refused, naming them."""
    wanted = _key(query)
    found = [
        hw
        for hw in descriptions
        if wanted and wanted in {_key(hw.name), _key(Path(hw.path).stem), *map(_key, hw.aliases)}
    ]
    if len(found) == 1:
        return found[0]
    if found:
        raise HardwareError(
            f"hardware name {query!r} is ambiguous: it could be {describe_names(found)}; "
            "give one of those names"
        )
    raise HardwareError(
        f"no hardware description named {query!r}; shipped: {describe_names(descriptions)}; "
        "or give a .toml file (docs/plan.md)"
    )


def _key(name: str) -> str:
    """``name`` lower-cased, letters and digits only: what name matching compares."""
    return "".join(char for char in name.lower() if char.isalnum())


def _read(path: Path) -> Hardware:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HardwareError(f"hardware file {path} is not valid TOML: {e}") from None
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise HardwareError(f"hardware file {path} lacks {', '.join(missing)}")
    known = set(Hardware.__dataclass_fields__) - {"path"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HardwareError(f"hardware file {path}: unknown keys {', '.join(unknown)}")
    if isinstance(data.get("aliases"), list):
        data["aliases"] = tuple(data["aliases"])
    try:
        hardware = Hardware(**data, path=str(path))
    except TypeError as e:
        raise HardwareError(f"hardware file {path}: {e}") from None
    return hardware


# Capability tables key dtypes by torch's names; hardware files by the config's.
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8": "fp8"}
FROM_BACKEND = ("name", "memory_gb", "peak_tflops")
"""The fields a backend's capability table can give (peaks: which dtypes the device
computes in, and the figures its plugin knows)."""
NOT_FROM_BACKEND = (
    "memory_bandwidth_gbs",
    "gpus_per_node",
    "intra_node_gbs",
    "inter_node_gbs",
    "intra_node_latency_us",
    "inter_node_latency_us",
    "nodes_per_pod",
    "inter_pod_gbs",
    "inter_pod_latency_us",
    "fused_attention",
    "matmul_tflops",
    "gemm_efficiency",
)
"""The fields no capability table gives: they always come from a description."""


@dataclass(frozen=True)
class BackendFill:
    """What ``fill_from_backend`` took from a backend: ``filled`` field -> value as
    shown, ``kept`` the fields left as the description has them, ``dropped`` the peak
    dtypes the description gives but the device does not compute in."""

    backend: str
    description: str
    filled: dict[str, str]
    kept: tuple[str, ...]
    dropped: tuple[str, ...]

    def summary(self) -> str:
        """Two lines for the report: where each field came from."""
        filled = ", ".join(f"{k} = {v}" for k, v in self.filled.items()) or "nothing"
        out = f"from backend {self.backend!r}: {filled}"
        if self.dropped:
            out += f" (no {', '.join(self.dropped)} on this device: peaks dropped)"
        return out + f"\nfrom the {self.description!r} description: {', '.join(self.kept)}"

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "description": self.description,
            "filled": self.filled,
            "kept": list(self.kept),
            "dropped_peaks": list(self.dropped),
        }


def fill_from_backend(hardware: Hardware, backend) -> tuple[Hardware, BackendFill]:
    """``hardware`` with what ``backend`` (a built ``mtcore.backend.Backend``) knows of
    its device: the device name, its memory, and its peaks: dtypes the device does
    not compute in (fp32, bf16, fp16; fp8 when the backend's FP8 is unavailable) lose
    theirs, and
    the figures the backend's plugin knows replace the description's. Everything
    else stays as the description has it (the backend knows no bandwidths)."""
    caps = backend.device.capabilities()
    where = f"backend {backend.name!r}"
    changes: dict = {}
    filled: dict[str, str] = {}
    sources = dict(hardware.sources)
    if caps.name:
        changes["name"], filled["name"] = caps.name, repr(caps.name)
    if caps.memory_bytes is not None and caps.memory_bytes <= 0:
        raise HardwareError(
            f"{where} reports {caps.memory_bytes} bytes of device memory; a device must have "
            "memory (its plugin's capabilities().memory_bytes)"
        )
    if caps.memory_bytes:
        changes["memory_gb"] = caps.memory_bytes / 1e9
        filled["memory_gb"] = f"{caps.memory_bytes / 1e9:.2f}"
    computes = {_TORCH_DTYPES[n] for n in map(_torch_name, caps.dtypes) if n in _TORCH_DTYPES}
    if backend.fp8.availability():
        computes.add("fp8")
    # Only the dtypes a capability table speaks of are judged (a tf32 peak stays).
    peaks = {
        k: v
        for k, v in hardware.peak_tflops.items()
        if k in computes or k not in _TORCH_DTYPES.values()
    }
    dropped = tuple(sorted(set(hardware.peak_tflops) - set(peaks)))
    known = {
        _TORCH_DTYPES[k]: float(v)
        for k, v in caps.peak_tflops.items()
        if k in _TORCH_DTYPES and v and _TORCH_DTYPES[k] in computes
    }
    peaks.update(known)
    if known or dropped:
        changes["peak_tflops"] = peaks
        filled["peak_tflops"] = ", ".join(f"{k} {v:g}" for k, v in sorted(known.items()))
        filled["peak_tflops"] = filled["peak_tflops"] or f"only {', '.join(sorted(peaks))}"
    for key in changes:
        sources[key] = f"{where} (device capabilities)"
    described = (k for k in Hardware.__dataclass_fields__ if k not in ("sources", "path"))
    kept = tuple(k for k in described if k not in changes and getattr(hardware, k) is not None)
    if "peak_tflops" in changes and set(peaks) - set(known):
        kept += (f"peak_tflops ({', '.join(sorted(set(peaks) - set(known)))})",)
    fill = BackendFill(backend.name, hardware.name, filled, kept, dropped)
    return replace(hardware, **changes, sources=sources), fill


def _torch_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
