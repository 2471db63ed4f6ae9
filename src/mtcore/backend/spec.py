"""What a plugin declares (``BackendSpec``) and what the core builds from it (``Backend``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from mtcore.backend.collective import Collective
from mtcore.backend.device import Availability, Device
from mtcore.backend.fp8 import FP8
from mtcore.backend.kernels import KernelImpl, KernelQuery, KernelTable


@dataclass(frozen=True)
class BackendSpec:
    """One backend as a plugin declares it.

    name: what users select (``MTCORE_BACKEND=name``).
    device / collective / fp8: the three interface objects; the fourth, the
      kernel table, is assembled by the core from every plugin's kernels.
    priority: order for automatic selection among available accelerators
      (higher first). Ignored when ``accelerator`` is False.
    accelerator: False for host backends, which auto-selection takes last.
    notes: lines that ``mtcore doctor`` prints (what was and was not tested).
    diagnostics: optional callable returning {label: value} facts that doctor
      prints (a detected compiler backend, a library version); it may probe
      the machine, so it runs only when doctor asks.
    dp_overlap: optional callable, asked when a data-parallel model is built on the
      device, saying whether launching the dp gradient reductions during backward
      (overlapping compute) is advised here, and why not (None: it is). The user's
      ``MTCORE_DP_OVERLAP`` overrides it (``mtcore.parallel.data``).
    """

    name: str
    device: Device
    collective: Collective
    fp8: FP8 = field(default_factory=FP8)
    priority: int = 0
    accelerator: bool = True
    description: str = ""
    notes: tuple[str, ...] = ()
    diagnostics: Callable[[], Mapping[str, str]] | None = None
    dp_overlap: Callable[[], Availability] | None = None

    def availability(self) -> Availability:
        # A driver that raises while probing must not break selection for everyone.
        try:
            return self.device.availability()
        except Exception as exc:
            return Availability(False, f"availability check raised {exc!r}", raised=True)

    def device_seen(self) -> bool:
        """Whether the device is plausibly here (a check that raises says it may be)."""
        try:
            return bool(self.device.device_seen())
        except Exception:
            return True


class Backend:
    """A selected backend: the four interfaces, ready for parallel and model code."""

    def __init__(self, spec: BackendSpec, plugin: str, kernels: list[KernelImpl]):
        self.spec = spec
        self.plugin = plugin
        self.name = spec.name
        # Set by automatic selection when it chose this backend over accelerator plugins
        # that could not serve although their device is plausibly here, or that conflict or
        # are broken (each line names the plugin and why); the trainer prints it.
        self.selection_notes: tuple[str, ...] = ()
        self.device = spec.device
        self.collective = spec.collective
        self.kernels = KernelTable(spec.name, kernels)
        table = self.kernels
        self.fp8 = spec.fp8.bound_to(
            table.fp8_quantize, table.fp8_quantize_transpose, table.fp8_dequantize
        )

    def torch_device(self, index: int | None = None) -> torch.device:
        return self.device.torch_device(index)

    def kernel_table(self, dtype: torch.dtype = torch.float32) -> dict[str, list[KernelImpl]]:
        return self.kernels.table(KernelQuery(self.device.type, dtype))

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, plugin={self.plugin!r}, device={self.device.type!r})"
