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

import functools
import platform

import torch

from mtcore.backend import host_fp8
from mtcore.backend.collective import Collective, gloo_capabilities
from mtcore.backend.device import CpuDevice
from mtcore.backend.fp8 import FP8
from mtcore.backend.fp8_paths import measured_paths
from mtcore.backend.hookspecs import hookimpl
from mtcore.backend.kernels import KernelImpl
from mtcore.backend.spec import BackendSpec
from mtcore.ops import flash_lse, torch_native

PLUGIN_NAME = "mtcore"
HOST_BACKEND = "cpu"

# torch._scaled_mm runs tensor-wise and row-wise scales on the CPU from torch 2.8 (2.7
# has no CPU kernel: "Could not run 'aten::_scaled_mm' ... 'CPU' backend"), so each pair
# is declared native only once a 16x16 product has run here; 1x128/128x128 blocks take
# the fallback matmul. Whether running a declared pair natively is faster is
# measured per machine and torch version (fp8_paths): CPUs without FP8 arithmetic
# run torch's _scaled_mm as a scalar loop, hundreds of times slower than the fallback.
NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})
_SCALES = {"tensor": lambda n: torch.ones(()), "row": lambda n: torch.ones(n, 1)}


def cpu_scaled_mm_pairs() -> frozenset[tuple[str, str]]:
    """The pairs of ``NATIVE_FP8`` that this torch's CPU ``torch._scaled_mm`` runs."""
    operand = torch.ones(16, 16).to(torch.float8_e4m3fn)
    works = set()
    for pair in NATIVE_FP8:
        scale_a, scale_b = (_SCALES[g](16) for g in pair)
        try:
            torch._scaled_mm(
                operand, operand.t(), scale_a=scale_a, scale_b=scale_b.t(), out_dtype=torch.float32
            )
        except (NotImplementedError, RuntimeError):
            continue
        works.add(pair)
    return frozenset(works)


@functools.cache
def cpu_identity() -> str:
    """The host CPU as the FP8 path measurement keys it: architecture, model and flags."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} | {model or platform.processor()} | {flags}"


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
    host = BackendSpec(
        name=HOST_BACKEND,
        device=CpuDevice(),
        collective=Collective("gloo", gloo_capabilities(), same_host_channels=True),
        fp8=FP8(
            native_granularities=cpu_scaled_mm_pairs,
            choose=functools.partial(measured_paths, machine=cpu_identity()),
        ),
        accelerator=False,
        diagnostics=lambda: {"FP8 quantize/dequantize": host_fp8.describe(cpu_identity())},
        description="host CPU: gloo collectives (tensor-parallel groups of one host through "
        "shared memory), torch fused SDPA/flash-LSE/RMSNorm/LayerNorm/"
        "cross-entropy/AdamW kernels, FP8 quantization in C compiled here, FP8 GEMMs "
        "through torch._scaled_mm where measured faster than the fallback matmul",
    )
    return [host]


@hookimpl
def mtcore_kernels(backend: str, device_type: str) -> list[KernelImpl]:
    if backend != HOST_BACKEND:
        return []
    impls = [
        # Not float16: torch's CPU SDPA backward rounds with a bias there (the kit's
        # bias check, -2.3e-4 on dK); the reference serves it.
        KernelImpl(
            "attention",
            torch_native.host_sdpa_attention,
            "sdpa",
            priority=50,
            predicate=lambda q: q.dtype != torch.float16,
            fallback_ok=torch_native.without_dropout,
        ),
        # float32/float64: F.rms_norm's forward with a hand-written backward.
        KernelImpl("rms_norm", torch_native.rms_norm_fp32, "torch-rms", priority=50),
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
    impls += _fp8_kernels()
    if flash_lse.cpu_flash_attention_lse_available():
        # torch's CPU flash kernel returns the log-sum-exp ring attention merges with.
        impls.append(
            KernelImpl(
                "attention_lse",
                flash_lse.cpu_flash_attention_lse,
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


def _fp8_kernels() -> list[KernelImpl]:
    """FP8 quantization and dequantization in C (``host_fp8``), built on first use: the
    predicates build it when a kernel table first resolves an FP8 op, and refuse where
    the build failed (the reference ops serve; ``host_fp8.unavailable_reason``)."""

    def takes_input(query) -> bool:
        return query.dtype in host_fp8.INPUT_DTYPES and host_fp8.load(cpu_identity())

    # A call dispatches dequantize on its FP8 bytes, a check (the kit's, the trainer's)
    # on the result's dtype; the guard checks the result's dtype of each call.
    def takes_bytes(query) -> bool:
        serves = (*host_fp8.FORMATS, *host_fp8.OUTPUT_DTYPES)
        return query.dtype in serves and host_fp8.load(cpu_identity())

    ops = (
        ("fp8_quantize", host_fp8.fp8_quantize, takes_input, host_fp8.quantize_fits),
        (
            "fp8_quantize_transpose",
            host_fp8.fp8_quantize_transpose,
            takes_input,
            host_fp8.quantize_fits,
        ),
        ("fp8_dequantize", host_fp8.fp8_dequantize, takes_bytes, host_fp8.dequantize_fits),
    )
    return [
        KernelImpl(op, fn, host_fp8.KERNEL_NAME, priority=50, predicate=accepts, fallback_ok=fits)
        for op, fn, accepts, fits in ops
    ]
