"""The mtcore-musa plugin: hook implementations for the 'musa' backend.

Nothing here imports torch_musa. The device imports it when its availability is
first asked for; the kernel probes run only when the backend is built.
"""

from __future__ import annotations

from mtcore.backend import (
    FP8,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    fp8_fallback_everywhere,
    hookimpl,
)
from mtcore_musa.devices import FP8_MIN_CAPABILITY, MUSA, MusaDevice
from mtcore_musa.kernels import musa_kernels
from mtcore_musa.triton_backend import musa_triton_backend

BACKEND = "musa"

# torch._scaled_mm reaches muDNN's scaled matmul with scalar or per-row (a) /
# per-column (b) scales on arch >= 3.1; 1x128/128x128 blocks take the dequantize fallback.
_NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})

NOTES = (
    "Written against the torch_musa API; not exercised on MUSA hardware in this "
    "project's CI (no MUSA GPU available).",
    "Verify on a Moore Threads machine with the conformance kit: "
    "pytest --pyargs mtcore.testing.conformance --mtcore-backend musa",
    "FP8 collectives move as bytes / reduce in float32: MCCL carries FP8 only when built "
    "with MCCL_FP8_SUPPORTED, and torch_musa exposes no runtime probe for it.",
    "rope uses torch_musa's F.rope for float32 only (the dtype its tests cover); other "
    "dtypes use the reference.",
)

# One device object for the process: the backend's device and the kernel predicates
# (which read its capability when an op first resolves) see the same torch.musa.
_DEVICE = MusaDevice(MUSA)


def _diagnostics() -> dict[str, str]:
    return {"triton backend for musa": musa_triton_backend() or "none detected"}


@hookimpl
def mtcore_backends():
    # MCCL maps ReduceOp.AVG to mcclAvg (csrc/distributed/ProcessGroupMCCL.cpp).
    capabilities = CollectiveCapabilities(fp8_fallback_everywhere(), avg_supported=True)
    musa = BackendSpec(
        name=BACKEND,
        device=_DEVICE,
        collective=Collective("mccl", capabilities),
        fp8=FP8.gated(_NATIVE_FP8, lambda: _DEVICE.capability_at_least(FP8_MIN_CAPABILITY)),
        priority=100,
        description="Moore Threads GPUs: MCCL collectives, muDNN attention and RMSNorm, "
        "torch_musa fused AdamW",
        notes=NOTES,
        diagnostics=_diagnostics,
    )
    return [musa]


@hookimpl
def mtcore_kernels(backend: str, device_type: str):
    if backend != BACKEND:
        return []
    return musa_kernels(_DEVICE)
