"""The hardware-neutral contract: four interfaces, plugin discovery, backend selection.

Parallel and model code reaches hardware only through a ``Backend``:
``backend.device``, ``backend.collective``, ``backend.kernels`` and ``backend.fp8``.
"""

from mtcore.backend.collective import (
    FP8_DTYPES,
    P2P,
    Collective,
    CollectiveCapabilities,
    Handle,
    Support,
    fp8_fallback_everywhere,
    gloo_capabilities,
)
from mtcore.backend.device import (
    Availability,
    CpuDevice,
    Device,
    DeviceCapabilities,
    DeviceModuleSpec,
    TorchModuleDevice,
    peaks_by_name,
)
from mtcore.backend.fp8 import FORMATS, FP8, Quantized
from mtcore.backend.hookspecs import ENTRY_POINT_GROUP, hookimpl
from mtcore.backend.host import cpu_scaled_mm_pairs
from mtcore.backend.kernels import (
    REFERENCE,
    KernelImpl,
    KernelQuery,
    KernelRegistrationError,
    KernelTable,
)
from mtcore.backend.plugins import PluginConfigError, PluginInfo, PluginRegistry, PluginWarning
from mtcore.backend.selection import BackendError, get_backend, plugin_registry, select_backend
from mtcore.backend.spec import Backend, BackendSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "FORMATS",
    "FP8",
    "FP8_DTYPES",
    "P2P",
    "REFERENCE",
    "Availability",
    "Backend",
    "BackendError",
    "BackendSpec",
    "Collective",
    "CollectiveCapabilities",
    "CpuDevice",
    "Device",
    "DeviceCapabilities",
    "DeviceModuleSpec",
    "Handle",
    "KernelImpl",
    "KernelQuery",
    "KernelRegistrationError",
    "KernelTable",
    "PluginConfigError",
    "PluginInfo",
    "PluginRegistry",
    "PluginWarning",
    "Quantized",
    "Support",
    "TorchModuleDevice",
    "cpu_scaled_mm_pairs",
    "fp8_fallback_everywhere",
    "get_backend",
    "gloo_capabilities",
    "hookimpl",
    "peaks_by_name",
    "plugin_registry",
    "select_backend",
]
