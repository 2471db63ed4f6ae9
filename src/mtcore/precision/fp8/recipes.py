"""FP8 recipes: which format and scaling each GEMM operand gets.

A recipe is plain data. Every FP8 linear quantizes three *roles*: the input
activation ``x``, the ``weight`` and the output gradient ``grad``.

Formats (``format``):
  "e4m3"    every role in E4M3 (3 mantissa bits, max 448).
  "hybrid"  input and weight in E4M3, gradients in E5M2 (2 mantissa bits, max
            57344): gradients need range more than precision (Micikevicius et
            al. 2022, "FP8 formats for deep learning").

Scaling (``scaling``):
  "delayed"    one scale per tensor from an amax history: ``scale = fp8_max /
               (max(history) * 2**margin)``; the history of the last
               ``amax_history_len`` amaxes is rolled on every quantization
               (Transformer Engine's DelayedScaling, amax_compute_algo="max").
  "current"    one scale per tensor from this tensor's own amax ("just in time").
  "blockwise"  1x128 blocks for activations and gradients, 128x128 blocks for
               weights, each scaled from its own amax (DeepSeek-V3).

Only the FP8 interface of the backend is used (``quantize``, ``scaled_matmul``);
where the backend has no native GEMM for a granularity pair, that interface
multiplies in higher precision instead (``FP8.describe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("e4m3", "hybrid")
SCALINGS = ("delayed", "current", "blockwise")
ROLES = ("input", "weight", "grad")

# Granularity of each role for the forward GEMM (x @ W^T); the backward GEMMs
# quantize the transposed operands with the same kind of unit (see linear.py).
_GRANULARITY = {
    "delayed": {"input": "tensor", "weight": "tensor", "grad": "tensor"},
    "current": {"input": "tensor", "weight": "tensor", "grad": "tensor"},
    "blockwise": {"input": "1x128", "weight": "128x128", "grad": "1x128"},
}


@dataclass(frozen=True)
class FP8Recipe:
    """How FP8 linears quantize.

    format: "e4m3" or "hybrid" (E4M3 forward, E5M2 gradients).
    scaling: "delayed", "current" or "blockwise".
    amax_history_len: delayed scaling: how many past amaxes the scale looks at.
    margin: delayed scaling: the scale is divided by ``2**margin`` (headroom for
      a tensor that grows between steps).
    first_last_high_precision: the first N and the last N transformer blocks keep
      their linears in the model dtype (the embedding and output layer never run FP8).
    """

    format: str = "hybrid"
    scaling: str = "delayed"
    amax_history_len: int = 16
    margin: int = 0
    first_last_high_precision: int = 0

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"fp8 format must be one of {FORMATS}, got {self.format!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8 recipe must be one of {SCALINGS}, got {self.scaling!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"fp8 amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"fp8 margin must be >= 0, got {self.margin}")
        if self.first_last_high_precision < 0:
            raise ValueError(
                f"fp8 first_last_high_precision must be >= 0, got {self.first_last_high_precision}"
            )

    def dtype(self, role: str) -> torch.dtype:
        """E4M3, or E5M2 for gradients under the hybrid format."""
        if role == "grad" and self.format == "hybrid":
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    def granularity(self, role: str) -> str:
        return _GRANULARITY[self.scaling][role]

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    def applies_to_block(self, index: int, num_layers: int) -> bool:
        """Whether transformer block ``index`` (global, 0-based) of ``num_layers`` runs FP8."""
        n = self.first_last_high_precision
        return n <= index < num_layers - n

    def gemm_pairs(self) -> dict[str, tuple[str, str]]:
        """Operand granularities (a, b) of the three GEMMs of a linear, for ``FP8.is_native``."""
        x, w, g = (self.granularity(r) for r in ROLES)
        # wgrad multiplies grad^T by x^T: both are activations, quantized like the input.
        return {"forward": (x, w), "dgrad": (g, w), "wgrad": (g, x)}

    def paths(self, fp8) -> dict[str, str]:
        """'native' or 'fallback (matmul in higher precision)' per GEMM on the FP8 interface ``fp8``
        (a GEMM of two formats, hybrid's dgrad and wgrad, only where ``fp8`` takes them)."""
        x, w, g = (self.dtype(r) for r in ROLES)
        formats = {"forward": (x, w), "dgrad": (g, w), "wgrad": (g, x)}
        return {
            gemm: "native"
            if fp8.is_native(a, b) and (len(set(formats[gemm])) == 1 or fp8.mixed_formats_native)
            else "fallback (matmul in higher precision)"
            for gemm, (a, b) in self.gemm_pairs().items()
        }

    def describe(self) -> str:
        grad = "E5M2" if self.format == "hybrid" else "E4M3"
        text = f"{self.scaling} scaling, E4M3 forward, {grad} gradients"
        if self.delayed:
            text += f", amax history {self.amax_history_len}, margin {self.margin}"
        return text


def check_backend_fp8(recipe: FP8Recipe, fp8) -> None:
    """Raise ValueError when the backend's FP8 interface ``fp8`` cannot run ``recipe``."""
    available = fp8.availability()
    if not available:
        raise ValueError(
            f"precision.fp8={recipe.format!r} needs FP8 support, which this backend lacks: "
            f"{available.reason}"
        )
