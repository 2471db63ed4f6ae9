"""Reference implementations of every kernel op: the numerical spec.

Pure torch, written for clarity and exactness, not speed. Accelerator plugins
register faster kernels under the same names and with the same parameter names;
the conformance kit checks them against the functions here, and
``MTCORE_KERNELS=reference`` runs these instead of any plugin kernel.
"""

from __future__ import annotations

from collections.abc import Callable

from mtcore.ops.activations import swiglu
from mtcore.ops.attention import attention
from mtcore.ops.attention_lse import attention_lse, merge_attention
from mtcore.ops.fp8 import (
    FP8_MAX,
    GRANULARITIES,
    fp8_dequantize,
    fp8_quantize,
    fp8_quantize_transpose,
)
from mtcore.ops.loss import cross_entropy
from mtcore.ops.moe import grouped_mm
from mtcore.ops.norms import layer_norm, rms_norm
from mtcore.ops.optim import adamw_step
from mtcore.ops.rope import rope, rope_tables

REFERENCE_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rope": rope,
    "swiglu": swiglu,
    "attention": attention,
    "attention_lse": attention_lse,
    "cross_entropy": cross_entropy,
    "adamw_step": adamw_step,
    "grouped_mm": grouped_mm,
    "fp8_quantize": fp8_quantize,
    "fp8_quantize_transpose": fp8_quantize_transpose,
    "fp8_dequantize": fp8_dequantize,
}

__all__ = [
    "FP8_MAX",
    "GRANULARITIES",
    "REFERENCE_OPS",
    "adamw_step",
    "attention",
    "attention_lse",
    "cross_entropy",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_quantize_transpose",
    "grouped_mm",
    "layer_norm",
    "merge_attention",
    "rms_norm",
    "rope",
    "rope_tables",
    "swiglu",
]
