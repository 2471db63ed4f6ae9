"""The FP8 interface: formats, quantize with amax, scaled matmul, granularities.

Quantization runs through the backend's ``fp8_quantize`` kernel op. The scaled
matmul uses ``torch._scaled_mm`` where the backend declares the pair of
granularities native, and otherwise falls back honestly to a matmul in higher
precision (``fallback_scaled_matmul``: the FP8 values multiplied and scaled once, or,
for blockwise scales, both operands dequantized). A backend on which torch runs a native
pair but not fast (the CPU: a scalar loop) passes ``choose``, which keeps a
declared pair native only where it measured it faster (``mtcore.backend.fp8_paths``).
``FP8.describe()`` says which path each granularity takes, ``FP8.why()`` why, and
``mtcore doctor`` prints both.

Convention (TN GEMM, as in TransformerEngine): ``scaled_matmul(a, b)`` returns
``a @ b.T`` for a [M, K] and b [N, K], both quantized along K.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from mtcore.backend.device import Availability
from mtcore.ops import FP8_MAX, GRANULARITIES, fp8_dequantize

GranularityPairs = frozenset[tuple[str, str]]
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Quantized:
    """An FP8 tensor: ``data`` [M, K], ``scale_inv`` and ``amax`` shaped by granularity.

    ``values`` (the FP8 values widened, unscaled) and ``dequantize`` remember their
    result per dtype, and a ``transpose()`` widens through its source: the fallback
    GEMMs of an FP8 linear read one operand, or its transpose, more than once (the
    output gradient in dgrad and wgrad, the weight in every GEMM of a step). Both run
    through ``dequantizer``: the backend's ``fp8_dequantize`` kernel op where the
    tensor came from ``FP8``, else the reference op.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    granularity: str
    dequantizer: Callable = field(default=fp8_dequantize, repr=False, compare=False)
    _wide: dict = field(default_factory=dict, repr=False, compare=False)
    _transpose_of: Quantized | None = field(default=None, repr=False, compare=False)

    def values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data`` in ``dtype`` (float32 or bfloat16: exact), without the scales."""
        if self._transpose_of is not None:
            return self._transpose_of.values(dtype).t()
        key = ("values", dtype)
        if key not in self._wide:
            one = torch.ones((), device=self.data.device)  # products by 1: exact
            self._wide[key] = self.dequantizer(self.data, one, "tensor", out_dtype=dtype)
        return self._wide[key]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._transpose_of is not None:
            return self._transpose_of.dequantize(dtype).t()
        key = ("dequantized", dtype)
        if key not in self._wide:
            self._wide[key] = self.dequantizer(
                self.data, self.scale_inv, self.granularity, out_dtype=dtype
            )
        return self._wide[key]

    def transpose(self) -> Quantized:
        """The same values transposed, no rounding: per tensor, or in 128x128 blocks,
        whose scales transpose with them (rows and 1x128 strips do not transpose). The
        data is a view; a native GEMM makes it contiguous."""
        if self.granularity not in ("tensor", "128x128"):
            raise ValueError(f"{self.granularity!r} scaling units do not transpose")
        scale_inv, amax = (t.t() if t.dim() == 2 else t for t in (self.scale_inv, self.amax))
        return Quantized(
            self.data.t(), scale_inv, amax, self.granularity, self.dequantizer, _transpose_of=self
        )


ShapeRule = Callable[[torch.Tensor, torch.Tensor], bool]
FALLBACK = "fallback (matmul in higher precision)"


@dataclass(frozen=True)
class GemmPath:
    """Whether a granularity pair's scaled matmul runs natively, why, and where that
    was decided (``source``: a measurement's date and cache file, or empty)."""

    native: bool
    reason: str
    source: str = ""


# declared native pairs -> the path each of them takes (see ``FP8``'s ``choose``)
PathChooser = Callable[[GranularityPairs], Mapping[tuple[str, str], GemmPath]]


def native_scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` through ``torch._scaled_mm`` (per-row ``b`` scales transposed to a row)."""
    scale_a = a.scale_inv.contiguous()
    scale_b = b.scale_inv.t().contiguous() if b.scale_inv.dim() == 2 else b.scale_inv
    return torch._scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
        out_dtype=out_dtype,
    )  # fmt: skip


def fallback_scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` without an FP8 GEMM.

    Per tensor and per row the scales do not vary along K, so this computes what an
    FP8 GEMM does: the FP8 values multiplied and summed (bfloat16 operands for a
    bfloat16 result, else float32; both hold FP8 values exactly, and the sum is taken
    in float32), then scaled in float32 and rounded once to ``out_dtype``. Products of
    FP8 values are exact and their sums nearly so, so the result hardly depends on the
    order of the sum, and a GEMM split along K or N (tensor parallel) gives what one
    process's gives. Dequantizing first would round every operand element and every
    product, differently for each summation order (per shard, per BLAS blocking), by
    enough to flip FP8 roundings downstream: tp=2 drifted from one process by 1e-2 in
    three steps of delayed scaling. Blockwise scales vary along K: both operands are
    dequantized to ``out_dtype`` and multiplied.
    """
    if a.granularity in _SCALES_ALONG_K or b.granularity in _SCALES_ALONG_K:
        return a.dequantize(out_dtype) @ b.dequantize(out_dtype).t()
    compute = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    scaled = (a.values(compute) @ b.values(compute).t()).float()  # a new tensor either way
    scaled.mul_(a.scale_inv)  # per tensor, or [M, 1]
    scaled.mul_(b.scale_inv.t() if b.scale_inv.dim() == 2 else b.scale_inv)  # or [1, N]
    return scaled.to(out_dtype)


_SCALES_ALONG_K = ("1x128", "128x128")


def k_n_multiple_of(multiple: int) -> ShapeRule:
    """A shape rule for :class:`FP8`: ``torch._scaled_mm`` runs natively only when K
    (``a.shape[1]``) and N (``b.shape[0]``) are multiples of ``multiple``; other shapes
    take the fallback matmul instead of an error from the device's GEMM library."""
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
      pair takes the fallback matmul.
    available: returns an ``Availability``; FP8 may need a minimum device capability.
    shape_ok: ``(a.data, b.data) -> bool``, whether the native GEMM takes these operand
      shapes (a [M, K], b [N, K]); others take the fallback. Each device library has its
      own rule; the default is K and N multiples of 16 (``k_n_multiple_of(16)``).
    mixed_formats: whether the native GEMM takes operands of two formats (e5m2 x e4m3,
      the hybrid recipe's gradient GEMMs), or a callable returning that (read on first
      use, like ``native_granularities``); where it does not, they take the fallback.
    choose: given the declared native pairs, the ``GemmPath`` of each (read on first
      use, with them): a declared pair whose native GEMM is slower than the fallback
      here takes the fallback (``mtcore.backend.fp8_paths.measured_paths``). None: every
      declared pair is native.
    """

    def __init__(
        self,
        native_granularities: GranularityPairs | Callable[[], GranularityPairs] = frozenset(),
        available: Callable[[], Availability] | None = None,
        shape_ok: ShapeRule = _scaled_mm_shape_ok,
        mixed_formats: bool | Callable[[], bool] = True,
        choose: PathChooser | None = None,
    ):
        self.shape_ok = shape_ok
        self._mixed_source = mixed_formats
        self._mixed: bool | None = None
        self._native_source = native_granularities
        self._choose = choose
        self._native: GranularityPairs | None = None
        self._paths: dict[tuple[str, str], GemmPath] = {}
        self._available = available or (lambda: Availability(True))
        self._quantize: Callable | None = None
        self._quantize_transpose: Callable | None = None
        self._dequantize: Callable = fp8_dequantize

    @property
    def native_granularities(self) -> GranularityPairs:
        """The pairs ``scaled_matmul`` runs natively: the declared ones, less those
        ``choose`` sends to the fallback."""
        if self._native is None:
            self._resolved_paths()
        return self._native

    def _resolved_paths(self) -> dict[tuple[str, str], GemmPath]:
        if self._native is None:
            source = self._native_source
            declared = frozenset(source() if callable(source) else source)
            if self._choose is None:
                paths = {
                    pair: GemmPath(True, "declared native by the backend") for pair in declared
                }
            else:
                paths = dict(self._choose(declared))
            self._paths = paths
            self._native = frozenset(pair for pair in declared if paths[pair].native)
        return self._paths

    @property
    def mixed_formats_native(self) -> bool:
        if self._mixed is None:
            source = self._mixed_source
            self._mixed = bool(source() if callable(source) else source)
        return self._mixed

    def bound_to(
        self,
        quantize: Callable,
        quantize_transpose: Callable | None = None,
        dequantize: Callable | None = None,
    ) -> FP8:
        """A copy that quantizes with ``quantize`` (a backend's kernel dispatcher), with
        ``quantize_transpose`` for :meth:`quantize_transpose` and ``dequantize`` for its
        tensors' fallback GEMMs when given."""
        bound = copy.copy(self)
        bound._quantize = quantize
        bound._quantize_transpose = quantize_transpose
        bound._dequantize = dequantize or fp8_dequantize
        return bound

    def quantized(
        self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, granularity: str
    ) -> Quantized:
        """A ``Quantized`` of this backend (one rebuilt from saved tensors, say)."""
        return Quantized(data, scale_inv, amax, granularity, self._dequantize)

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
        mixed_formats: bool | Callable[[], bool] = True,
    ) -> FP8:
        """FP8 whose native pairs exist only while ``gate()`` holds (a capability rule)."""
        return cls(
            lambda: native if gate() else frozenset(),
            available=gate,
            shape_ok=shape_ok,
            mixed_formats=mixed_formats,
        )

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
        return self.quantized(data, scale_inv, amax, granularity)

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
        return (
            self.quantized(data, scale_inv, amax, granularity),
            self.quantized(data_t, scale_inv_t, amax_t, granularity),
        )

    def is_native(self, a_granularity: str, b_granularity: str) -> bool:
        return (a_granularity, b_granularity) in self.native_granularities

    def takes_natively(self, a: Quantized, b: Quantized) -> bool:
        """Whether ``scaled_matmul(a, b)`` runs ``torch._scaled_mm``: the granularity
        pair, the formats (two of them only where ``mixed_formats``) and the shape."""
        if not self.is_native(a.granularity, b.granularity):
            return False
        if a.data.dtype != b.data.dtype and not self.mixed_formats_native:
            return False
        return self.shape_ok(a.data, b.data)

    def scaled_matmul(self, a: Quantized, b: Quantized, out_dtype=torch.float32) -> torch.Tensor:
        """``a @ b.T`` in ``out_dtype``; native when the granularity pair, the formats and
        the shape (``shape_ok``: by default K and N multiples of 16) allow it, else
        dequantize and multiply."""
        if a.data.shape[1] != b.data.shape[1]:
            raise ValueError(
                f"scaled_matmul: K differs, a {tuple(a.data.shape)} b {tuple(b.data.shape)}"
            )
        if self.takes_natively(a, b):
            return native_scaled_matmul(a, b, out_dtype)
        return fallback_scaled_matmul(a, b, out_dtype)

    @staticmethod
    def _described_pairs() -> dict[str, tuple[str, str]]:
        """Label -> operand pair: each granularity with itself, and blockwise's 1x128 x 128x128."""
        pairs = [(g, g) for g in GRANULARITIES] + [("1x128", "128x128")]
        return {(f"{a} x {b}" if a != b else a): (a, b) for a, b in pairs}

    def describe(self) -> dict[str, str]:
        """Path taken per operand granularity pair (for doctor): "native" or ``FALLBACK``."""
        return {
            label: "native" if self.is_native(*pair) else FALLBACK
            for label, pair in self._described_pairs().items()
        }

    def why(self) -> dict[str, str]:
        """Why each pair of ``describe()`` takes its path (for doctor)."""
        paths = self._resolved_paths()
        return {
            label: paths[pair].reason if pair in paths else "no native GEMM for this pair here"
            for label, pair in self._described_pairs().items()
        }

    def path_sources(self) -> list[str]:
        """Where the native-or-fallback choices were made (measurements and their caches)."""
        return sorted({path.source for path in self._resolved_paths().values() if path.source})
