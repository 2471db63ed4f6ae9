"""Hook implementations: mtcore imports this module through the entry point.

Hooks run at discovery time, in every process that uses mtcore: keep them
cheap, import nothing that may fail, and never touch the hardware here.
"""

from __future__ import annotations

from mtcore.backend import (
    FP8,
    BackendSpec,
    Collective,
    CpuDevice,
    KernelImpl,
    cpu_scaled_mm_pairs,
    gloo_capabilities,
    hookimpl,
)
from mtcore_example.kernels import floating_on_cpu, sigmoid_swiglu

BACKEND = "example"
TENSOR_WISE = frozenset({("tensor", "tensor")})


@hookimpl
def mtcore_backends():
    return [
        BackendSpec(
            name=BACKEND,
            device=CpuDevice(),
            # gloo carries no FP8 dtype, and before torch 2.8 no ReduceOp.AVG and a
            # reduce-scatter that only sums: gloo_capabilities() says so for the torch
            # installed, and the collective takes its fallbacks (bytes for data
            # movement, float32 for reductions, sum-then-divide for AVG).
            collective=Collective("gloo", gloo_capabilities()),
            # torch._scaled_mm runs tensor-wise scales on the CPU from torch 2.8; the
            # host's probe says whether this torch does. Other granularities take the
            # fallback matmul.
            fp8=FP8(native_granularities=lambda: cpu_scaled_mm_pairs() & TENSOR_WISE),
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
