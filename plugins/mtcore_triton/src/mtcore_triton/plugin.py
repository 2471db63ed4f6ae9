"""The mtcore-triton plugin: the Triton kernel pack, offered to any backend Triton can drive.

A kernel pack only (no backend). Discovery imports this module, which imports
neither triton nor the kernels. When a backend is built, ``mtcore_kernels`` asks
the one finder (:func:`mtcore_triton.targets.find_target`) whether an active
Triton driver targets the backend's torch device type; the target table then
gives the pack's priority and whether its FP8 ops are offered. The backend's
name plays no part: a new accelerator plugin whose device type a Triton build
targets gets the pack without a change here.
"""

from __future__ import annotations

from mtcore.backend import KernelImpl, hookimpl
from mtcore_triton.registration import triton_kernel_impls
from mtcore_triton.targets import find_target, triton_installed

# The host is not offered the pack: its backend has torch's fused CPU kernels, Triton's
# CPU paths (the interpreter, the triton-cpu fork) are for debugging or unverified, and
# skipping it keeps importing triton out of every CPU process. The tests reach the
# interpreter through ``triton_kernel_impls("cpu")`` directly.
HOST_DEVICE_TYPE = "cpu"


def _fp8_verified(device_type: str) -> bool:
    # Asked when an FP8 op first resolves, after the rank picked its device.
    target = find_target(device_type)
    return target is not None and target.fp8_verified()


@hookimpl
def mtcore_kernels(backend: str, device_type: str) -> list[KernelImpl]:
    if device_type == HOST_DEVICE_TYPE or not triton_installed():
        return []
    target = find_target(device_type)
    if target is None or not target.offered():
        return []
    return triton_kernel_impls(
        device_type,
        priority=target.traits.priority,
        fp8_supported=lambda: _fp8_verified(device_type),
    )
