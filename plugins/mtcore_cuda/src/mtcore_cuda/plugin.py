"""The mtcore-cuda plugin: hook implementations for the 'cpu' and 'cuda' backends."""

from __future__ import annotations

import torch

from mtcore.backend import (
    FP8,
    FP8_DTYPES,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    CpuDevice,
    KernelImpl,
    TorchModuleDevice,
    fp8_fallback_everywhere,
    hookimpl,
)
from mtcore.ops import torch_native
from mtcore_cuda.devices import CUDA, FP8_MIN_CAPABILITY
from mtcore_cuda.triton_kernels.registration import (
    triton_backend_for,
    triton_installed,
    triton_kernel_impls,
)

# One device object for the process: the backend and the Triton pack's FP8 gate
# (float8e4nv exists from capability 8.9, as torch._scaled_mm) read the same one.
_CUDA_DEVICE = TorchModuleDevice(CUDA)

# A MUSA Triton backend runs the pack too; below muDNN's probed kernels (priority 50),
# which are the vendor's tuned path, and above the reference.
MUSA_TRITON_PRIORITY = 40

# Tensor-wise and row-wise scales run in torch._scaled_mm on the CPU and on
# capability >= 8.9 GPUs; 1x128/128x128 blocks take the dequantize fallback.
_NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})


# ProcessGroupNCCL moves FP8 tensors but refuses to reduce them.
_NCCL_FP8_REDUCTIONS = {op: frozenset(FP8_DTYPES) for op in ("all_reduce", "reduce_scatter")}


def _fused_adamw_fits(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    # torch's fused kernel wants params and optimizer state in one dtype.
    return all(p.dtype == m.dtype for p, m in zip(params, exp_avgs, strict=True))


@hookimpl
def mtcore_backends():
    cpu = BackendSpec(
        name="cpu",
        device=CpuDevice(),
        collective=Collective("gloo", CollectiveCapabilities(fp8_fallback_everywhere(), avg_supported=False)),
        fp8=FP8(native_granularities=_NATIVE_FP8),
        accelerator=False,
        description="host CPU: gloo collectives, torch fused SDPA/RMSNorm/LayerNorm/AdamW kernels, FP8 through torch._scaled_mm",
    )
    cuda_device = _CUDA_DEVICE
    cuda = BackendSpec(
        name="cuda",
        device=cuda_device,
        collective=Collective("nccl", CollectiveCapabilities(_NCCL_FP8_REDUCTIONS)),
        fp8=FP8.gated(_NATIVE_FP8, lambda: cuda_device.capability_at_least(FP8_MIN_CAPABILITY)),
        priority=100,
        description="NVIDIA GPUs: NCCL collectives, SDPA attention, fused AdamW",
    )
    return [cpu, cuda]


@hookimpl
def mtcore_kernels(backend: str, device_type: str):
    # The Triton pack (extra [triton]) for the cuda backend, and for musa where a
    # Triton backend drives MUSA devices; triton itself is imported on first call,
    # except for the musa check, which asks triton's backend registry.
    if backend == "musa":
        if triton_installed() and triton_backend_for("musa"):
            # FP8 in Triton on MUSA is unverified: the FP8 ops stay with the reference there.
            return triton_kernel_impls(
                device_type, priority=MUSA_TRITON_PRIORITY, fp8_supported=lambda: False
            )
        return []
    # torch's own fused CPU kernels serve the cpu backend as well: the reference
    # ops stay the spec (MTCORE_KERNELS=reference forces them), not the hot path.
    if backend not in ("cpu", "cuda"):
        return []
    impls = [
        KernelImpl("attention", torch_native.sdpa_attention, "sdpa", priority=50),
    ]
    if backend == "cpu":
        impls.append(KernelImpl("rms_norm", torch_native.fused_rms_norm, "torch-fused", priority=50))
        # In float32 only, like swiglu: the reference rounds a bf16 result once, from fp32.
        impls.append(
            KernelImpl(
                "layer_norm",
                torch_native.fused_layer_norm,
                "torch-fused",
                priority=50,
                predicate=lambda q: q.dtype == torch.float32,
            )
        )
        # In float32 only: the reference computes bf16 inputs in fp32, F.silu would not.
        impls.append(
            KernelImpl(
                "swiglu",
                torch_native.silu_glu,
                "torch-silu",
                priority=50,
                predicate=lambda q: q.dtype == torch.float32,
            )
        )
    if torch_native.fused_adamw_available():
        impls.append(
            KernelImpl(
                "adamw_step",
                torch_native.fused_adamw_step,
                "torch-fused",
                priority=50,
                predicate=lambda q: q.dtype == torch.float32,
                fallback_ok=_fused_adamw_fits,
            )
        )
    if backend == "cuda" and triton_installed():
        impls += triton_kernel_impls(
            device_type,
            fp8_supported=lambda: bool(_CUDA_DEVICE.capability_at_least(FP8_MIN_CAPABILITY)),
        )
    return impls
