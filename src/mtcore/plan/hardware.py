"""Accelerator descriptions: published specs as data files, one TOML file per accelerator.

The shipped files live in ``mtcore/plan/hardware/`` and name the source of each
number (or say it is an estimate) in their ``[sources]`` table. A user adds an
accelerator by writing a file of the same shape and passing its path
(``mtcore plan --hardware my.toml``). Bandwidths are per accelerator and per
direction, in GB/s (1e9 bytes); peaks are dense (no structured sparsity) TFLOP/s.

A running backend's capability table (``Device.capabilities()``, what ``mtcore
doctor`` prints) fills in what it knows over a description: ``fill_from_backend``.
"""

from __future__ import annotations

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
    """One accelerator and the links around it (what the planner needs, nothing more)."""

    name: str
    memory_gb: float
    memory_bandwidth_gbs: float
    gpus_per_node: int
    intra_node_gbs: float
    inter_node_gbs: float
    peak_tflops: dict[str, float]
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    fused_attention: bool = True
    matmul_tflops: float | None = None  # measured max achievable dense bf16 matmul, if published
    sources: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for matrix products in ``dtype`` (bf16, fp16, fp32, fp8)."""
        if dtype not in self.peak_tflops:
            known = ", ".join(sorted(self.peak_tflops))
            raise HardwareError(f"{self.name} gives no peak for {dtype} (it has: {known})")
        return self.peak_tflops[dtype] * 1e12

    def link(self, ranks: int, stride: int) -> tuple[float, float]:
        """(bytes/s per rank, latency s) of a collective over ``ranks`` ranks placed
        ``stride`` ranks apart (nodes hold ``gpus_per_node`` consecutive ranks).

        Inside one node: the intra-node link. Across nodes, a ring crosses the
        network; the group's members on one node drive their own network ports in
        parallel rings (as NCCL-style libraries do), so the bandwidth is the
        per-accelerator network bandwidth times the members per node, at most the
        intra-node link's.
        """
        if ranks * stride <= self.gpus_per_node:
            return self.intra_node_gbs * 1e9, self.intra_node_latency_us * 1e-6
        per_node = max(1, self.gpus_per_node // stride)
        bandwidth = min(self.intra_node_gbs, self.inter_node_gbs * per_node)
        return bandwidth * 1e9, self.inter_node_latency_us * 1e-6


def builtin_names() -> list[str]:
    """The shipped descriptions' names (``A100-80GB``, ``H100-SXM``, ...)."""
    return sorted(_read(path).name for path in HARDWARE_DIR.glob("*.toml"))


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped description by name (case-insensitive) or a TOML file by path."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise HardwareError(f"hardware file not found: {path}")
        return _read(path)
    for candidate in sorted(HARDWARE_DIR.glob("*.toml")):
        hardware = _read(candidate)
        if name_or_path.lower() in (hardware.name.lower(), candidate.stem.lower()):
            return hardware
    raise HardwareError(
        f"no hardware description named {name_or_path!r}; shipped: "
        f"{', '.join(builtin_names())}, or give a .toml file (docs/plan.md)"
    )


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
    try:
        hardware = Hardware(**data, path=str(path))
        numbers = [hardware.memory_gb, hardware.memory_bandwidth_gbs, hardware.intra_node_gbs]
        numbers += [hardware.inter_node_gbs, hardware.gpus_per_node]
        numbers += list(hardware.peak_tflops.values())
        numbers += [hardware.matmul_tflops] if hardware.matmul_tflops is not None else []
        if not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 for n in numbers
        ):
            raise TypeError("memory, bandwidths, gpus_per_node and peaks must be positive numbers")
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
    "fused_attention",
    "matmul_tflops",
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
