"""The mtcore-cuda plugin: hook implementations for the 'cuda' backend (NVIDIA GPUs).

The host ``cpu`` backend is the core's own (``mtcore.backend.host``).
"""

from __future__ import annotations

import torch

from mtcore.backend import (
    FP8,
    FP8_DTYPES,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    KernelImpl,
    TorchModuleDevice,
    hookimpl,
)
from mtcore.backend.host import fused_adamw_fits
from mtcore.ops import torch_native
from mtcore_cuda.attention import cuda_flash_attention_lse, flash_lse_ok
from mtcore_cuda.devices import CUDA, FP8_MIN_CAPABILITY
from mtcore_cuda.flex_documents import flex_document_attention, flex_documents_ok

# torch's flash attention kernels need compute capability 8.0 (Ampere) or newer.
FLASH_MIN_CAPABILITY = (8, 0)

BACKEND = "cuda"

# One device object for the process: the backend and its FP8 gate read the same one.
# The Triton kernel pack is a plugin of its own (mtcore-triton, extra [triton]).
_CUDA_DEVICE = TorchModuleDevice(CUDA)

# Tensor-wise and row-wise scales run in torch._scaled_mm on capability >= 8.9 GPUs;
# 1x128/128x128 blocks take the fallback matmul.
_NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})

# ProcessGroupNCCL moves FP8 tensors but refuses to reduce them.
_NCCL_FP8_REDUCTIONS = {op: frozenset(FP8_DTYPES) for op in ("all_reduce", "reduce_scatter")}


@hookimpl
def mtcore_backends() -> list[BackendSpec]:
    cuda_device = _CUDA_DEVICE
    cuda = BackendSpec(
        name=BACKEND,
        device=cuda_device,
        collective=Collective(
            "nccl",
            CollectiveCapabilities(_NCCL_FP8_REDUCTIONS),
            # NCCL's traffic between nodes, then the gloo groups (checkpoint I/O, CPU tensors).
            interface_variables=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
        ),
        fp8=FP8.gated(_NATIVE_FP8, lambda: cuda_device.capability_at_least(FP8_MIN_CAPABILITY)),
        priority=100,
        description="NVIDIA GPUs: NCCL collectives, SDPA attention, fused AdamW",
    )
    return [cuda]


@hookimpl
def mtcore_kernels(backend: str, device_type: str) -> list[KernelImpl]:
    if backend != BACKEND:
        return []
    impls = [
        # Packed samples (document ids): FlexAttention's block mask skips the blocks of
        # other documents (flex_documents.py; not run on a GPU here); other calls fall to SDPA.
        KernelImpl(
            "attention",
            flex_document_attention,
            "flex-documents",
            priority=60,
            fallback_ok=flex_documents_ok,
        ),
        # SDPA's own dropout is not the op's coordinate-hashed mask: the reference serves it.
        KernelImpl(
            "attention",
            torch_native.sdpa_attention,
            "sdpa",
            priority=50,
            fallback_ok=torch_native.without_dropout,
        ),
        KernelImpl(
            "attention_lse",
            cuda_flash_attention_lse,
            "flash",
            priority=50,
            predicate=lambda q: (
                q.dtype in (torch.float16, torch.bfloat16)
                and bool(_CUDA_DEVICE.capability_at_least(FLASH_MIN_CAPABILITY))
            ),
            fallback_ok=flash_lse_ok,
        ),
    ]
    if torch_native.fused_adamw_available():
        impls.append(
            KernelImpl(
                "adamw_step",
                torch_native.fused_adamw_step,
                "torch-fused",
                priority=50,
                predicate=lambda q: q.dtype == torch.float32,
                fallback_ok=fused_adamw_fits,
            )
        )
    return impls
