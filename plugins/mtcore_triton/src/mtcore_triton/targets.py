"""Which Triton driver runs the pack on a backend's device, and what the pack knows of it.

The one finder: Triton backends register under names that vary by build (NVIDIA's
``nvidia``, AMD's ``amd``, Moore Threads' ``mtgpu``, FlagTree's ``mthreads``), but
each active driver reports a ``GPUTarget(backend, arch, warp_size)`` from
``get_current_target()``, and ``backend`` is the stable fact ("cuda", "hip",
"musa"). So every registered backend whose driver is active is asked for its
target, and the target names the torch device type whose tensors it runs on.

Vendor knowledge is data, in :data:`TARGETS`, keyed by that target backend. A target
the table does not list runs the pack on the torch device type of its own name,
below any vendor kernel and without FP8 (:data:`UNLISTED`).

Nothing here imports triton at module import; :func:`find_target` does (a fraction
of a second once torch is loaded), so it runs when a backend is built or when
doctor asks, never at plugin discovery.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetTraits:
    """What the pack knows about one Triton target backend.

    device_type: the torch device type whose tensors the target's kernels take.
    priority: the pack's place among that backend's implementations (higher first;
      the reference ops sit at the bottom, vendor-tuned kernels usually at 50).
    fp8_min_arch: the FP8 kernels are offered from this ``GPUTarget.arch`` on (an
      integer arch); None: never, because FP8 in Triton is unverified there.
    min_arch: the pack is offered at all from this integer ``GPUTarget.arch`` on (None:
      every arch); ``min_arch_why`` says where the bound comes from.
    """

    device_type: str
    priority: int
    fp8_min_arch: int | None
    min_arch: int | None = None
    min_arch_why: str = ""


# Keyed by GPUTarget.backend. Each entry says why.
TARGETS: dict[str, TargetTraits] = {
    # NVIDIA: above torch-native kernels (torch-fused AdamW, priority 50), which the
    # pack beats or complements; Triton's float8e4nv exists from capability 8.9 (Ada),
    # reported as arch 89, the same gate as torch._scaled_mm.
    "cuda": TargetTraits(device_type="cuda", priority=60, fp8_min_arch=89),
    # AMD ROCm: torch calls the device "cuda" there, and the backend's other kernels
    # are the same torch-native ones, so the same place as on NVIDIA. FP8 off: MI300
    # uses the fnuz formats, not the OCP e4m3fn/e5m2 the pack writes, and the pack was
    # not run on AMD hardware in this project.
    "hip": TargetTraits(device_type="cuda", priority=60, fp8_min_arch=None),
    # Moore Threads MUSA: below the muDNN kernels mtcore-musa probes (priority 50),
    # which are the vendor's tuned path, above the reference; FP8 in Triton on MUSA is
    # unverified, so the FP8 ops stay with muDNN or the reference. Not below arch 31
    # (MUSA's GPUTarget.arch is 10 major + minor, torch_musa/core/_utils.py
    # _get_musa_arch): torch_musa v2.7.1 replaced its own Triton cross entropy because
    # "triton kernel launch faild on S4000" (the S4000 is arch 22; torch_musa/distributed/
    # loss.py:21), and runs FSDP2 without overlap below 31 (distributed/_composable/fsdp/
    # patch.py:215-219).
    "musa": TargetTraits(
        device_type="musa",
        priority=40,
        fp8_min_arch=None,
        min_arch=31,
        min_arch_why="torch_musa found Triton kernel launches failing on the S4000 (arch 22): "
        "torch_musa/distributed/loss.py:21",
    ),
}

# A target no entry lists (a new vendor's Triton): below a vendor's own kernels, no FP8.
UNLISTED_PRIORITY = 40


def traits_of(target_backend: str) -> TargetTraits:
    """The table entry for ``target_backend``, or the unlisted default for it."""
    listed = TARGETS.get(target_backend)
    if listed is not None:
        return listed
    return TargetTraits(device_type=target_backend, priority=UNLISTED_PRIORITY, fp8_min_arch=None)


@dataclass(frozen=True)
class TritonTarget:
    """An active Triton driver and the target it compiles for.

    name: the key in ``triton.backends.backends`` ("nvidia", "mtgpu", ...).
    backend, arch, warp_size: the driver's ``GPUTarget`` for the current device.
    """

    name: str
    backend: str
    arch: int | str
    warp_size: int

    @property
    def traits(self) -> TargetTraits:
        return traits_of(self.backend)

    def fp8_verified(self) -> bool:
        """Whether the pack's FP8 kernels are offered on this target (table data)."""
        least = self.traits.fp8_min_arch
        return least is not None and isinstance(self.arch, int) and self.arch >= least

    def offered(self) -> bool:
        """Whether the pack is offered on this target at all (table data: ``min_arch``)."""
        least = self.traits.min_arch
        return least is None or (isinstance(self.arch, int) and self.arch >= least)

    def describe(self) -> str:
        found = f"{self.name} (target {self.backend}, arch {self.arch}, warp size {self.warp_size})"
        if self.offered():
            return found
        why = self.traits.min_arch_why
        return f"{found}; the pack is not offered below arch {self.traits.min_arch} ({why})"


def triton_installed() -> bool:
    """Whether triton can be imported, without importing it."""
    return importlib.util.find_spec("triton") is not None


def find_target(device_type: str) -> TritonTarget | None:
    """The active Triton driver whose target runs kernels on ``device_type`` tensors.

    Imports triton (call it when a backend is built, not at discovery). Any failure
    (no triton, a backend whose driver cannot load, no device) means None for that
    driver: the backend then keeps its other kernels and the reference.
    """
    if not triton_installed():
        return None
    try:
        backends = importlib.import_module("triton.backends").backends
    except Exception:
        return None
    for name, backend in dict(backends).items():
        try:
            driver = backend.driver
            if not driver.is_active():
                continue
            target = driver().get_current_target()
            found = TritonTarget(name, str(target.backend), target.arch, int(target.warp_size))
        except Exception:
            continue
        if found.traits.device_type == device_type:
            return found
    return None


def describe_target(device_type: str) -> str:
    """One line for doctor: the driver and its target for ``device_type``, or why none."""
    if not triton_installed():
        return "triton not installed"
    found = find_target(device_type)
    return found.describe() if found is not None else "none detected"
