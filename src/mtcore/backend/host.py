"""The core's own plugin: the ``cpu`` backend, so ``pip install mtcore`` alone trains.

It is registered by every ``PluginRegistry`` before any entry point, under the
plugin name ``mtcore``, and is not subject to ``MTCORE_PLUGINS`` or
``MTCORE_DISABLE_PLUGIN_AUTOLOAD``: the host is always there. Accelerator plugins
supply only their accelerators; a plugin that declares a backend named ``cpu``
is refused (see ``PluginRegistry.backends``).

The kernels are torch's own fused CPU operators (``mtcore.ops.torch_native``);
the reference ops stay the spec, and ``MTCORE_KERNELS=reference`` forces them.
"""

from __future__ import annotations

import torch

from mtcore.backend.collective import Collective, CollectiveCapabilities, fp8_fallback_everywhere
from mtcore.backend.device import CpuDevice
from mtcore.backend.fp8 import FP8
from mtcore.backend.hookspecs import hookimpl
from mtcore.backend.kernels import KernelImpl
from mtcore.backend.spec import BackendSpec
from mtcore.ops import torch_native

PLUGIN_NAME = "mtcore"
HOST_BACKEND = "cpu"

# torch._scaled_mm runs tensor-wise and row-wise scales on the CPU; 1x128/128x128
# blocks take the dequantize fallback.
NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})

# ProcessGroupGloo gained ReduceOp.AVG in torch 2.8 (pytorch/pytorch#149781); before
# that mtcore's Collective turns AVG into SUM and a division.
GLOO_AVG_SINCE = "2.8"


def _float32(query) -> bool:
    return query.dtype == torch.float32


def fused_adamw_fits(
    params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay
):
    """torch's fused kernel wants params and optimizer state in one dtype (the cuda
    plugin's fused AdamW reuses this guard)."""
    return all(p.dtype == m.dtype for p, m in zip(params, exp_avgs, strict=True))


@hookimpl
def mtcore_backends() -> list[BackendSpec]:
    avg = torch.__version__ >= GLOO_AVG_SINCE
    host = BackendSpec(
        name=HOST_BACKEND,
        device=CpuDevice(),
        collective=Collective(
            "gloo",
            CollectiveCapabilities(fp8_fallback_everywhere(), avg_supported=avg),
            same_host_channels=True,
        ),
        fp8=FP8(native_granularities=NATIVE_FP8),
        accelerator=False,
        description="host CPU: gloo collectives (tensor-parallel groups of one host through "
        "shared memory), torch fused SDPA/flash-LSE/RMSNorm/LayerNorm/"
        "cross-entropy/AdamW kernels, FP8 through torch._scaled_mm",
    )
    return [host]


@hookimpl
def mtcore_kernels(backend: str, device_type: str) -> list[KernelImpl]:
    if backend != HOST_BACKEND:
        return []
    impls = [
        KernelImpl("attention", torch_native.sdpa_attention, "sdpa", priority=50),
        KernelImpl("rms_norm", torch_native.fused_rms_norm, "torch-fused", priority=50),
        # Every dtype: F.layer_norm runs on float32 operands and the result is rounded
        # once, as the reference specifies (for float32 inputs the casts are no-ops).
        KernelImpl("layer_norm", torch_native.fused_layer_norm_fp32, "torch-fused", priority=50),
        # F.cross_entropy on float32 logits: the reference's float32 log-softmax, fused.
        KernelImpl("cross_entropy", torch_native.fused_cross_entropy, "torch-fused", priority=50),
        # torch has no fused rotary kernel on the CPU: the reference's forward arithmetic
        # with a hand-written backward (no zero-filled slice buffers).
        KernelImpl("rope", torch_native.rope_rotation, "torch-rotation", priority=50),
        # Every dtype: F.silu on float32 operands, one rounding, as the reference.
        KernelImpl("swiglu", torch_native.silu_glu_fp32, "torch-silu", priority=50),
    ]
    if torch_native.cpu_flash_attention_lse_available():
        # torch's CPU flash kernel returns the log-sum-exp ring attention merges with.
        impls.append(
            KernelImpl(
                "attention_lse",
                torch_native.cpu_flash_attention_lse,
                "cpu-flash",
                priority=50,
                predicate=lambda q: q.dtype in (torch.float32, torch.bfloat16),
            )
        )
    if torch_native.fused_adamw_available():
        impls.append(
            KernelImpl(
                "adamw_step",
                torch_native.fused_adamw_step,
                "torch-fused",
                priority=50,
                predicate=_float32,
                fallback_ok=fused_adamw_fits,
            )
        )
    return impls
