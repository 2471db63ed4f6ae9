"""Predicted time of one rank's compute and memory-bound work (collectives: ``network``).

Matrix products run at the fraction of the dtype's peak that the hardware file's
measured GEMM-shape table gives for their shape (``gemm``), or, without a table, at
``GEMM_EFFICIENCY`` of the peak (scaled by the accelerator's published maximum
achievable matmul share relative to the fit accelerator's); element-wise kernels
through memory at ``LINK_EFFICIENCY`` of the memory bandwidth. The loss over the
vocabulary is counted op by op, in fp32 (``cross_entropy_bytes``).
"""

from __future__ import annotations

from functools import cache

from mtcore.plan import constants, gemm
from mtcore.plan.hardware import Hardware, load_hardware

ELEMENTWISE_PASSES = 5
"""Memory traffic of the element-wise work (norms, activations, softmax, dropout,
residual adds) of one layer, in units of the bytes the layer keeps for backward:
forward reads each kept tensor's input and writes the tensor (2), backward reads
it, reads the incoming gradient and writes the outgoing one (3). Counted, not
fitted; a full recompute adds a forward (2)."""


def gemm_flops(hardware: Hardware, peak: float) -> float:
    """FLOP/s the model credits large matrix products whose dtype peaks at ``peak`` on
    ``hardware``: ``GEMM_EFFICIENCY`` of the peak (fitted on the accelerator named by
    ``constants.FIT_HARDWARE``), times the accelerator's published maximum achievable
    matmul share of its peak over the fit accelerator's (``matmul_share``). Without a
    published measurement an accelerator is credited the fit accelerator's share."""
    share, fitted = matmul_share(hardware), matmul_share(_fit_hardware())
    ratio = share / fitted if share and fitted else 1.0
    return peak * constants.GEMM_EFFICIENCY * ratio


def matmul_share(hardware: Hardware) -> float | None:
    """The hardware file's measured maximum achievable dense bf16 matmul TFLOP/s
    (``matmul_tflops``, a published measurement named in its [sources]) over its bf16
    peak; None when the file gives none. One figure per accelerator, for every dtype."""
    if not hardware.matmul_tflops or "bf16" not in hardware.peak_tflops:
        return None
    return hardware.matmul_tflops / hardware.peak_tflops["bf16"]


class Products:
    """Seconds of matrix products in ``dtype`` on ``hardware``, one shape at a time; the
    transformer blocks' weight products in ``block_dtype`` (fp8 when ``precision.fp8``
    is set and the file has an fp8 peak, else ``dtype``)."""

    def __init__(
        self,
        hardware: Hardware,
        dtype: str,
        block_dtype: str | None = None,
        fp8_recipe: str = "delayed",
        fp8_experts: bool = False,
    ):
        self.hardware = hardware
        self.dtype, self.block_dtype = dtype, block_dtype or dtype
        self.fp8_recipe = fp8_recipe  # precision.fp8_recipe: its quantization's traffic
        self.fp8_experts = (
            fp8_experts  # the experts' products in fp8 too (stage.precision_products)
        )

    def seconds(self, shape: tuple[float, float, float], calls: float = 1.0, block=False) -> float:
        """``calls`` products ``[M, K] @ [K, N]`` (``shape``), forward."""
        m, k, n = shape
        return self.flops_seconds(calls * 2.0 * m * k * n, 2.0 * m * k * n, shape, block)

    def flops_seconds(self, flops: float, one: float, shape=None, block=False) -> float:
        """``flops`` of products of ``one`` FLOPs each (their shape unknown, or ``shape``)."""
        dtype = self.block_dtype if block else self.dtype
        peak = self.hardware.peak_flops(dtype)
        table = (self.hardware.gemm_efficiency or {}).get(dtype)
        if table is None:
            return flops / gemm_flops(self.hardware, peak)
        whole = tuple(round(d) for d in shape) if shape is not None else None
        return flops / (peak * gemm.efficiency(table, one, whole))

    def note(self) -> str:
        """Which efficiency the products were credited, for the report."""
        dtypes = sorted({self.dtype, self.block_dtype})
        parts = []
        for dtype in dtypes:
            table = (self.hardware.gemm_efficiency or {}).get(dtype)
            if table is None:
                share = gemm_flops(self.hardware, 1.0)
                parts.append(
                    f"{dtype} products at the single constant {share:.3f} of peak "
                    f"(no {dtype} GEMM-shape table in the {self.hardware.name} file)"
                )
            else:
                parts.append(
                    f"{dtype} products at the {self.hardware.name} file's measured GEMM-shape "
                    f"table ({len(table)} shapes, interpolated by size)"
                )
        return "; ".join(parts)


@cache
def _fit_hardware() -> Hardware:
    return load_hardware(constants.FIT_HARDWARE)


def cross_entropy_bytes(e: int) -> float:
    """Memory traffic per logit (one token, one vocabulary entry) of the loss, for
    logits of ``e`` bytes: the loss runs in fp32 over the whole vocabulary shard.

    Counted from Megatron's ``vocab_parallel_cross_entropy`` (2021, and Megatron-Core
    r0.8: ``calculate_logits_max`` casts the logits with ``.float()``), one op at a
    time. Forward: the head's product writes the logits (e); the cast reads them and
    writes fp32 (e + 4); the max reads (4); subtracting it reads and writes (8); the
    exponential reads and writes (8); the sum reads (4); dividing by it reads and
    writes the softmax kept for backward (8). Backward: scaling the softmax by the
    incoming gradient reads and writes (8); the cast back reads fp32 and writes e.
    ``F.cross_entropy`` on fp32 logits (mtcore's) moves about the same by this count
    (3e + 44). Counted, not fitted.
    """
    forward = e + (e + 4) + 4 + 8 + 8 + 4 + 8
    backward = 8 + (4 + e)
    return forward + backward


def fp8_quantize_bytes(e: int, recipe: str) -> float:
    """Memory traffic per element of a tensor quantized to FP8 for a product (its input,
    its weight, or backward its output's gradient), from ``e``-byte values: read them (e),
    write the FP8 bytes (1); ``current`` scaling first reads them for the amax (e);
    ``blockwise`` also writes the transposed copy its other product reads (1, the fused
    quantize-and-transpose, docs/fp8.md). Delayed scaling's amax rides on the quantize.
    Counted, not fitted."""
    return e + 1 + (e if recipe == "current" else 0) + (1 if recipe == "blockwise" else 0)


def memory_bound(hardware: Hardware, size_bytes: float) -> float:
    return size_bytes / (hardware.memory_bandwidth_gbs * 1e9 * constants.LINK_EFFICIENCY)
