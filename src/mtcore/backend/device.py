"""The device interface: one accelerator type as parallel and model code sees it.

Two implementations live here, both hardware-neutral:

* ``CpuDevice`` for the host.
* ``TorchModuleDevice`` for any accelerator that PyTorch exposes as a device
  module (``torch.get_device_module(type)``). Plugins describe their accelerator
  with a ``DeviceModuleSpec`` (data: the device type string, the module to import
  first, the visible-devices variable, capability rules) and get the whole
  implementation from here instead of copying it.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here and, if not, why (shown by ``mtcore doctor``)."""

    ok: bool
    reason: str = ""
    raised: bool = False  # the check itself raised (a plugin bug, said whatever the device)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device can do.

    peak_tflops: dense (no sparsity) peak TFLOP/s keyed by torch dtype name
    ("float32", "bfloat16", "float16") or "float8" for FP8 tensor-core peak;
    absent keys mean unknown. MFU is computed against these.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    peak_tflops: Mapping[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None


class Device:
    """The device contract. Subclasses override what differs from the host."""

    type: str = "cpu"

    def availability(self) -> Availability:
        return Availability(True)

    def device_seen(self) -> bool:
        """Whether this machine shows signs of the device (its driver's files), whether or
        not the backend can run: an unavailable backend whose device is seen is worth a warning."""
        return False

    # -- placement -----------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def current_index(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"{self.type} has one device; asked for index {index}")

    def torch_device(self, index: int | None = None) -> torch.device:
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, self.current_index() if index is None else index)

    def synchronize(self) -> None:
        return None

    # -- streams and events --------------------------------------------------------
    def stream(self):
        """A new side stream (or a no-op stand-in on devices without streams)."""
        return torch.cpu.Stream()

    def use_stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def event(self, enable_timing: bool = False):
        # torch.cpu.Event() takes no arguments: host events cannot time.
        return torch.cpu.Event() if hasattr(torch.cpu, "Event") else None

    # -- memory --------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return _proc_status_kib("VmRSS") * 1024

    def max_memory_allocated(self) -> int:
        # Linux's VmHWM is not monotone: the kernel folds the resident size into it only
        # at some events, so a reading after memory was returned can be lower than one
        # before (the conformance kit's peak check saw it fall 52 KiB). Keep the high
        # water mark of our own readings, as the device modules do.
        seen = max(_proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")) * 1024
        self._peak = max(getattr(self, "_peak", 0), seen)
        return self._peak

    def reset_peak_memory_stats(self) -> None:
        # Linux resets the peak RSS (VmHWM) when "5" is written to clear_refs.
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._peak = 0

    def empty_cache(self) -> None:
        return None

    # -- traces --------------------------------------------------------------------
    def trace_range(self, name: str) -> contextlib.AbstractContextManager:
        """The device's own marker around one of mtcore's named phases, entered only while
        a trace is being recorded (``mtcore.backend.tracing``; mtcore times the range on
        the host itself, whatever this returns). Default: torch.profiler's
        ``record_function``, a host-side range that torch.profiler's trace shows with the
        ops run inside it (and, where torch.profiler sees the device, with the device's
        share). A device whose vendor has range markers its own profiler shows returns
        those as well."""
        return torch.profiler.record_function(name)

    # -- random numbers ------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork_rng(self) -> Iterator[None]:
        """Run a block with its own RNG stream and restore the outer state after."""
        state = self.get_rng_state()
        try:
            yield
        finally:
            self.set_rng_state(state)

    # -- precision -----------------------------------------------------------------
    def autocast(self, dtype: torch.dtype, enabled: bool = True):
        return torch.autocast(device_type=self.type, dtype=dtype, enabled=enabled)

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(
            name=_cpu_name(),
            dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
            memory_bytes=_meminfo_total(),
        )


class CpuDevice(Device):
    """The host CPU."""

    type = "cpu"


PeakRule = Callable[[str, tuple[int, int]], Mapping[str, float]]


def peaks_by_name(table: tuple[tuple[str, Mapping[str, float]], ...]) -> PeakRule:
    """A peak rule from (name marker, {dtype: TFLOP/s}) rows; the first marker in the name wins."""

    def rule(name: str, capability: tuple[int, int]) -> dict[str, float]:
        return next((dict(peaks) for marker, peaks in table if marker in name), {})

    return rule


@dataclass(frozen=True)
class DeviceModuleSpec:
    """Data that turns ``TorchModuleDevice`` into one vendor's device.

    device_type: torch device type string, as in ``torch.device(device_type)``.
    import_name: module to import before the device type exists (None if built in).
    visible_devices_env: environment variable that restricts visible devices.
    device_files: glob patterns of files the device's driver creates (device nodes,
      /proc entries); one that exists means the device is plausibly here.
    bf16_min_capability: lowest (major, minor) with native bf16.
    peak_tflops: rule from (device name, capability) to {dtype name: TFLOP/s}.
    """

    device_type: str
    import_name: str | None = None
    visible_devices_env: str | None = None
    device_files: tuple[str, ...] = ()
    bf16_min_capability: tuple[int, int] = (0, 0)
    peak_tflops: PeakRule | None = None


class TorchModuleDevice(Device):
    """A device driven through ``torch.get_device_module(spec.device_type)``."""

    def __init__(self, spec: DeviceModuleSpec):
        self.spec = spec
        self.type = spec.device_type
        self._module = None

    @property
    def module(self):
        if self._module is None:
            if self.spec.import_name:
                importlib.import_module(self.spec.import_name)
            self._module = torch.get_device_module(self.type)
        return self._module

    def availability(self) -> Availability:
        try:
            module = self.module
        except ImportError as exc:
            return Availability(False, f"cannot import {self.spec.import_name!r}: {exc}")
        except (RuntimeError, AttributeError, ValueError) as exc:
            return Availability(False, f"torch has no device module {self.type!r}: {exc}")
        if not module.is_available():
            hint = ""
            env = self.spec.visible_devices_env
            if env and env in os.environ:
                hint = f" ({env}={os.environ[env]!r})"
            return Availability(False, f"no {self.type} device is visible{hint}")
        return Availability(True)

    def device_seen(self) -> bool:
        return any(glob.glob(pattern) for pattern in self.spec.device_files)

    def capability_at_least(self, minimum: tuple[int, int]) -> Availability:
        """Whether the current device reaches ``minimum`` (major, minor), and why not."""
        available = self.availability()
        if not available:
            return available
        found = tuple(self.module.get_device_capability(self.module.current_device()))
        if found < tuple(minimum):
            return Availability(False, f"needs {self.type} capability {minimum}, device has {found}")
        return Availability(True)

    def device_count(self) -> int:
        return self.module.device_count()

    def current_index(self) -> int:
        return self.module.current_device()

    def set_device(self, index: int) -> None:
        self.module.set_device(index)

    def synchronize(self) -> None:
        self.module.synchronize()

    def stream(self):
        return self.module.Stream()

    def use_stream(self, stream):
        return self.module.stream(stream)

    def event(self, enable_timing: bool = False):
        return self.module.Event(enable_timing=enable_timing)

    def memory_allocated(self) -> int:
        return self.module.memory_allocated()

    def max_memory_allocated(self) -> int:
        return self.module.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the host and every device generator

    def get_rng_state(self) -> torch.Tensor:
        return self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.module.set_rng_state(state)

    def capabilities(self) -> DeviceCapabilities:
        module = self.module
        index = module.current_device()
        props = module.get_device_properties(index)
        capability = tuple(module.get_device_capability(index))
        dtypes = [torch.float32, torch.float16]
        if capability >= self.spec.bf16_min_capability:
            dtypes.append(torch.bfloat16)
        peak = self.spec.peak_tflops(props.name, capability) if self.spec.peak_tflops else {}
        return DeviceCapabilities(
            name=props.name,
            dtypes=tuple(dtypes),
            peak_tflops=dict(peak),
            memory_bytes=getattr(props, "total_memory", None),
            compute_capability=capability,
        )


def _proc_status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
