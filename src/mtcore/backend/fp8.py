"""The FP8 interface: formats, quantize with amax, scaled matmul, granularities.

Quantization runs through the backend's ``fp8_quantize`` kernel op. The scaled
matmul uses ``torch._scaled_mm`` where the backend declares the pair of
granularities native, and otherwise falls back honestly: dequantize both
operands and multiply in ``out_dtype``. ``FP8.describe()`` says which path each
granularity takes, and ``mtcore doctor`` prints it.

Convention (TN GEMM, as in TransformerEngine): ``scaled_matmul(a, b)`` returns
``a @ b.T`` for a [M, K] and b [N, K], both quantized along K.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtcore.backend.device import Availability
from mtcore.ops import FP8_MAX, GRANULARITIES, fp8_dequantize

GranularityPairs = frozenset[tuple[str, str]]
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Quantized:
    """An FP8 tensor: ``data`` [M, K], ``scale_inv`` and ``amax`` shaped by granularity."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    granularity: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp8_dequantize(self.data, self.scale_inv, self.granularity, out_dtype=dtype)


ShapeRule = Callable[[torch.Tensor, torch.Tensor], bool]


def k_n_multiple_of(multiple: int) -> ShapeRule:
    """A shape rule for :class:`FP8`: ``torch._scaled_mm`` runs natively only when K
    (``a.shape[1]``) and N (``b.shape[0]``) are multiples of ``multiple``; other shapes
    take the dequantize fallback instead of an error from the device's GEMM library."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")

    def rule(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape[1] % multiple == 0 and b.shape[0] % multiple == 0

    rule.__qualname__ = rule.__name__ = f"k_n_multiple_of({multiple})"
    return rule


# The default is cuBLASLt's rule (torch's own check before its FP8 GEMM: K and N % 16);
# CPU's torch._scaled_mm takes those shapes too. Backends with another rule pass theirs.
_scaled_mm_shape_ok = k_n_multiple_of(16)


class FP8:
    """FP8 support of one backend.

    native_granularities: (a, b) granularity pairs that ``torch._scaled_mm`` runs
      natively on this backend, or a callable returning them (read on first use,
      for backends where the answer depends on the device found); every other
      pair takes the dequantize fallback.
    available: returns an ``Availability``; FP8 may need a minimum device capability.
    shape_ok: ``(a.data, b.data) -> bool``, whether the native GEMM takes these operand
      shapes (a [M, K], b [N, K]); others take the fallback. Each device library has its
      own rule; the default is K and N multiples of 16 (``k_n_multiple_of(16)``).
    """

    def __init__(
        self,
        native_granularities: GranularityPairs | Callable[[], GranularityPairs] = frozenset(),
        available: Callable[[], Availability] | None = None,
        shape_ok: ShapeRule = _scaled_mm_shape_ok,
    ):
        self.shape_ok = shape_ok
        self._native_source = native_granularities
        self._native: GranularityPairs | None = None
        self._available = available or (lambda: Availability(True))
        self._quantize: Callable | None = None
        self._quantize_transpose: Callable | None = None

    @property
    def native_granularities(self) -> GranularityPairs:
        if self._native is None:
            source = self._native_source
            self._native = frozenset(source() if callable(source) else source)
        return self._native

    def bound_to(self, quantize: Callable, quantize_transpose: Callable | None = None) -> FP8:
        """A copy that quantizes with ``quantize`` (a backend's kernel dispatcher), and
        with ``quantize_transpose`` for :meth:`quantize_transpose` when given."""
        bound = copy.copy(self)
        bound._quantize = quantize
        bound._quantize_transpose = quantize_transpose
        return bound

    @property
    def formats(self) -> dict[str, torch.dtype]:
        return dict(FORMATS)

    @staticmethod
    def max_value(dtype: torch.dtype) -> float:
        return FP8_MAX[dtype]

    @classmethod
    def gated(
        cls,
        native: GranularityPairs,
        gate: Callable[[], Availability],
        shape_ok: ShapeRule = _scaled_mm_shape_ok,
    ) -> FP8:
        """FP8 whose native pairs exist only while ``gate()`` holds (a capability rule)."""
        return cls(lambda: native if gate() else frozenset(), available=gate, shape_ok=shape_ok)

    def availability(self) -> Availability:
        return self._available()

    def quantize(
        self,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: str = "tensor",
        scale: torch.Tensor | None = None,
    ) -> Quantized:
        """Quantize a 2-D tensor; ``scale`` (delayed scaling) overrides the current amax."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
        quantize = self._quantize
        if quantize is None:
            from mtcore.ops import fp8_quantize as quantize
        data, scale_inv, amax = quantize(x, dtype, granularity, scale)
        return Quantized(data, scale_inv, amax, granularity)

    def quantize_transpose(
        self,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: str = "tensor",
        scale: torch.Tensor | None = None,
    ) -> tuple[Quantized, Quantized]:
        """Quantize ``x`` [M, K] and ``x.T`` [K, M] in one pass, each along its last dim.

        The second operand serves the transposed GEMM (weight gradient) in the TN
        convention of :meth:`scaled_matmul`; see ``mtcore.ops.fp8_quantize_transpose``.
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
        fused = self._quantize_transpose
        if fused is None:
            from mtcore.ops import fp8_quantize_transpose as fused
        (data, scale_inv, amax), (data_t, scale_inv_t, amax_t) = fused(x, dtype, granularity, scale)
        return Quantized(data, scale_inv, amax, granularity), Quantized(
            data_t, scale_inv_t, amax_t, granularity
        )

    def is_native(self, a_granularity: str, b_granularity: str) -> bool:
        return (a_granularity, b_granularity) in self.native_granularities

    def scaled_matmul(self, a: Quantized, b: Quantized, out_dtype=torch.float32) -> torch.Tensor:
        """``a @ b.T`` in ``out_dtype``; native when the granularity pair and the shape
        (``shape_ok``: by default K and N multiples of 16) allow it, else dequantize and
        multiply."""
        if a.data.shape[1] != b.data.shape[1]:
            raise ValueError(f"scaled_matmul: K differs, a {tuple(a.data.shape)} b {tuple(b.data.shape)}")
        if self.is_native(a.granularity, b.granularity) and self.shape_ok(a.data, b.data):
            scale_b = b.scale_inv.t() if b.scale_inv.dim() == 2 else b.scale_inv
            return torch._scaled_mm(
                a.data, b.data.t(), scale_a=a.scale_inv, scale_b=scale_b, out_dtype=out_dtype
            )
        return a.dequantize(out_dtype) @ b.dequantize(out_dtype).t()

    def describe(self) -> dict[str, str]:
        """Path taken per operand granularity pair (for doctor); blockwise is 1x128 x 128x128."""
        pairs = [(g, g) for g in GRANULARITIES] + [("1x128", "128x128")]
        return {
            f"{a} x {b}" if a != b else a: "native" if self.is_native(a, b) else "fallback (dequantize + matmul)"
            for a, b in pairs
        }
