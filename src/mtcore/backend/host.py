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


def fused_adamw_fits(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    """torch's fused kernel wants params and optimizer state in one dtype (the cuda
    plugin's fused AdamW reuses this guard)."""
    return all(p.dtype == m.dtype for p, m in zip(params, exp_avgs, strict=True))


@hookimpl
def mtcore_backends() -> list[BackendSpec]:
    avg = torch.__version__ >= GLOO_AVG_SINCE
    host = BackendSpec(
        name=HOST_BACKEND,
        device=CpuDevice(),
        collective=Collective("gloo", CollectiveCapabilities(fp8_fallback_everywhere(), avg_supported=avg)),
        fp8=FP8(native_granularities=NATIVE_FP8),
        accelerator=False,
        description="host CPU: gloo collectives, torch fused SDPA/flash-LSE/RMSNorm/LayerNorm/"
        "AdamW kernels, FP8 through torch._scaled_mm",
    )
    return [host]


@hookimpl
def mtcore_kernels(backend: str, device_type: str) -> list[KernelImpl]:
    if backend != HOST_BACKEND:
        return []
    impls = [
        KernelImpl("attention", torch_native.sdpa_attention, "sdpa", priority=50),
        KernelImpl("rms_norm", torch_native.fused_rms_norm, "torch-fused", priority=50),
        # float32 only, like swiglu: the reference rounds a bf16 result once, from fp32.
        KernelImpl("layer_norm", torch_native.fused_layer_norm, "torch-fused", priority=50, predicate=_float32),
        # float32 only: the reference computes bf16 inputs in fp32, F.silu would not.
        KernelImpl("swiglu", torch_native.silu_glu, "torch-silu", priority=50, predicate=_float32),
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
