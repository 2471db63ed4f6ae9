"""Accelerator descriptions: published specs as data files, one TOML file per accelerator.

The shipped files live in ``mtcore/plan/hardware/`` and name the source of each
number (or say it is an estimate) in their ``[sources]`` table. A user adds an
accelerator by writing a file of the same shape and passing its path
(``mtcore plan --hardware my.toml``). Bandwidths are per accelerator and per
direction, in GB/s (1e9 bytes); peaks are dense (no structured sparsity) TFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
        if not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 for n in numbers
        ):
            raise TypeError("memory, bandwidths, gpus_per_node and peaks must be positive numbers")
    except TypeError as e:
        raise HardwareError(f"hardware file {path}: {e}") from None
    return hardware
