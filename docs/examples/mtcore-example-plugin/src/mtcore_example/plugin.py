"""Hook implementations: mtcore imports this module through the entry point.

Hooks run at discovery time, in every process that uses mtcore: keep them
cheap, import nothing that may fail, and never touch the hardware here.
"""

from __future__ import annotations

from mtcore.backend import (
    FP8,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    CpuDevice,
    KernelImpl,
    fp8_fallback_everywhere,
    hookimpl,
)
from mtcore_example.kernels import floating_on_cpu, sigmoid_swiglu

BACKEND = "example"


@hookimpl
def mtcore_backends():
    return [
        BackendSpec(
            name=BACKEND,
            device=CpuDevice(),
            # gloo carries no FP8 dtype: say so, and the collective takes its fallback
            # (bytes for data movement, float32 for reductions). It has ReduceOp.AVG
            # from torch 2.8; a library without it sets avg_supported=False and gets
            # sum-then-divide.
            collective=Collective("gloo", CollectiveCapabilities(fp8_fallback_everywhere())),
            # torch._scaled_mm runs tensor-wise scales on the CPU; other granularities
            # take the dequantize fallback.
            fp8=FP8(native_granularities=frozenset({("tensor", "tensor")})),
            # Not an accelerator: automatic selection never picks it; users ask for it
            # by name (MTCORE_BACKEND=example).
            accelerator=False,
            description="example plugin: host CPU, gloo, a sigmoid SwiGLU kernel",
            notes=("example code from the mtcore plugin author guide; not for training runs",),
        )
    ]


@hookimpl
def mtcore_kernels(backend: str, device_type: str):
    if backend != BACKEND:
        return []
    return [
        KernelImpl(
            op="swiglu",
            fn=sigmoid_swiglu,
            name="sigmoid-swiglu",
            priority=20,
            predicate=floating_on_cpu,
        )
    ]
