"""The pack as ``KernelImpl`` objects, without importing triton until a kernel runs.

The functions below carry each reference op's exact parameter names (the
registry checks them) and forward to the Triton modules, imported on first
call. Predicates admit the backend's device type and float32 / bfloat16 /
float16; the ``*_ok`` guards send everything else (strided rows, hidden sizes
beyond a block, tables that need gradients, tensors on another device) to the
next implementation, ultimately the reference. Which backend gets the pack, at
which priority and with or without FP8 is :mod:`mtcore_triton.plugin`'s choice.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable

import torch

from mtcore.backend import KernelImpl, KernelQuery

NAME = "triton"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HIDDEN = 16384  # norms: one row per program, in registers (norms.MAX_HIDDEN)
MAX_ROPE_TILE = 16384  # rope: heads x head_dim / 2 of one position, in registers
FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.cache
def _pack() -> types.SimpleNamespace:
    mods = ("norms", "pointwise", "cross_entropy", "adamw", "fp8")
    return types.SimpleNamespace(**{m: importlib.import_module(f"mtcore_triton.{m}") for m in mods})


# -- the ops, with the reference parameter names ----------------------------------------
def rms_norm(x, weight, eps=1e-6):
    return _pack().norms.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps=1e-5):
    return _pack().norms.layer_norm(x, weight, bias, eps)


def rope(x, cos, sin):
    return _pack().pointwise.rope(x, cos, sin)


def swiglu(x):
    return _pack().pointwise.swiglu(x)


def cross_entropy(logits, target, ignore_index=-100):
    return _pack().cross_entropy.cross_entropy(logits, target, ignore_index)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    _pack().adamw.adamw_step(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
    )


def fp8_quantize(x, dtype, granularity, scale=None):
    return _pack().fp8.fp8_quantize(x, dtype, granularity, scale)


def fp8_quantize_transpose(x, dtype, granularity, scale=None):
    return _pack().fp8.fp8_quantize_transpose(x, dtype, granularity, scale)


# -- guards: what the kernels take; anything else goes to the next implementation -------
def _rows_ok(x, *affine) -> bool:
    if x.dim() == 0 or not 1 <= x.shape[-1] <= MAX_HIDDEN or x.stride(-1) != 1:
        return False
    return all(
        t is None or (t.device == x.device and t.dtype in DTYPES and t.dim() == 1) for t in affine
    )


def rms_norm_ok(x, weight, eps=1e-6) -> bool:
    return _rows_ok(x, weight)


def layer_norm_ok(x, weight, bias, eps=1e-5) -> bool:
    return _rows_ok(x, weight, bias)


def rope_ok(x, cos, sin) -> bool:
    if x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1:
        return False
    tile = _pow2(x.shape[2]) * _pow2(x.shape[3] // 2)
    want = (x.shape[1], x.shape[3] // 2)
    return tile <= MAX_ROPE_TILE and all(
        tuple(t.shape) == want
        and t.dtype == torch.float32
        and t.device == x.device
        and not t.requires_grad  # the kernel differentiates x only
        for t in (cos, sin)
    )


def swiglu_ok(x) -> bool:
    return x.dim() > 0 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1


def cross_entropy_ok(logits, target, ignore_index=-100) -> bool:
    return (
        logits.dim() == 2
        and logits.shape[1] > 0
        and target.dim() == 1
        and target.shape[0] == logits.shape[0]
        and target.dtype == torch.int64
        and target.device == logits.device
    )


def adamw_ok(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    if not params or step < 1:
        return False
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(t) for t in lists}) != 1:
        return False
    device = params[0].device
    for p, g, m, v in zip(*lists, strict=True):
        if m.dtype != torch.float32 or v.dtype != torch.float32 or p.dtype not in DTYPES:
            return False
        if not (p.shape == g.shape == m.shape == v.shape) or not g.is_floating_point():
            return False
        if any(t.device != device or not t.is_contiguous() for t in (p, g, m, v)):
            return False
    return True


def fp8_quantize_ok(x, dtype, granularity, scale=None) -> bool:
    return (
        x.dim() == 2
        and x.numel() > 0
        and dtype in FP8_FORMATS
        and granularity in ("tensor", "row", "1x128", "128x128")
        and (scale is None or granularity == "tensor")
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_OPS = (
    ("rms_norm", rms_norm, rms_norm_ok),
    ("layer_norm", layer_norm, layer_norm_ok),
    ("rope", rope, rope_ok),
    ("swiglu", swiglu, swiglu_ok),
    ("cross_entropy", cross_entropy, cross_entropy_ok),
    ("adamw_step", adamw_step, adamw_ok),
    ("fp8_quantize", fp8_quantize, fp8_quantize_ok),
    ("fp8_quantize_transpose", fp8_quantize_transpose, fp8_quantize_ok),
)


def triton_kernel_impls(
    device_type: str, priority: int = 60, fp8_supported: Callable[[], bool] | None = None
) -> list[KernelImpl]:
    """The pack for tensors of ``device_type``, each impl guarded by its ``*_ok``.

    ``fp8_supported``: whether the FP8 ops may run in Triton on this device (the
    target table's gate); asked when an FP8 op first resolves, not here. None
    admits them (the interpreter tables of the tests).

    ``priority`` places the pack among a backend's other implementations; adamw_step
    sits 20 below it so torch's multi-tensor fused AdamW (priority 50) keeps
    the all-float32 lists it takes and the pack serves the rest (bf16 params).
    """

    def predicate(query: KernelQuery) -> bool:
        return query.device_type == device_type and query.dtype in DTYPES

    def fp8_predicate(query: KernelQuery) -> bool:
        return predicate(query) and (fp8_supported is None or bool(fp8_supported()))

    return [
        KernelImpl(
            op,
            fn,
            NAME,
            priority=priority - 20 if op == "adamw_step" else priority,
            predicate=fp8_predicate if op.startswith("fp8") else predicate,
            fallback_ok=ok,
        )
        for op, fn, ok in _OPS
    ]
