"""Reference FP8 quantisation with per-unit scaling.

A *scaling unit* is the set of elements that share one scale:

===========  =========================  ==========================================
granularity  unit                       ``scale_inv`` / ``amax`` shape for ``[M, K]``
===========  =========================  ==========================================
"tensor"     the whole tensor           ``[]`` (0-dim)
"row"        one row                    ``[M, 1]``
"1x128"      1 row x 128 columns        ``[M, ceil(K/128)]``
"128x128"    128 rows x 128 columns     ``[ceil(M/128), ceil(K/128)]``
===========  =========================  ==========================================

Blocks start at index 0; the last block along a dimension may be partial.
The quantised value is ``data = x * scale`` and the original is recovered as
``data * scale_inv`` (the convention of scaled matmuls, which take ``scale_inv``).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,  # 57344
}
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "1x128", "128x128")
BLOCK = 128
_FP32_MAX = torch.finfo(torch.float32).max


def unit_shape(shape: tuple[int, int], granularity: str) -> tuple[int, ...]:
    m, k = shape
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (m, 1)
    if granularity == "1x128":
        return (m, math.ceil(k / BLOCK))
    if granularity == "128x128":
        return (math.ceil(m / BLOCK), math.ceil(k / BLOCK))
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def fp8_quantize(
    x: Tensor, dtype: torch.dtype, granularity: str, scale: Tensor | float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Quantise a 2-D tensor to FP8 with one scale per scaling unit.

    Per unit (see the module table)::

        amax      = max |x|                                   (float32)
        scale     = FP8_MAX[dtype] / amax, or 1 where amax == 0
        data      = clamp(x * scale, -FP8_MAX, FP8_MAX).to(dtype)   # round to nearest even
        scale_inv = 1 / scale                                 (float32)

    ``scale`` is capped at the largest finite float32 so a denormal ``amax``
    cannot give an infinite scale (Transformer Engine does the same).
    ``x`` must be finite; NaN/inf inputs have no specified result.

    Args:
        x: ``[M, K]``, any floating dtype, non-empty.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: one of :data:`GRANULARITIES`.
        scale: delayed scaling: a given scale (a float or a one-element tensor,
            e.g. from an amax history) used instead of the computed one. Only
            for ``"tensor"``. Values beyond the format range saturate.

    Returns:
        ``(data, scale_inv, amax)``: ``data`` ``[M, K]`` in ``dtype``;
        ``scale_inv`` and ``amax`` float32 with the unit shape. ``amax`` is
        always the amax of this ``x``, also when ``scale`` is given, so the
        caller can append it to its history.

    Not differentiable: FP8 recipes quantise inside their own autograd
    functions and define the backward there.
    """
    check_quantize_args(x, dtype, granularity, scale)
    fmax = FP8_MAX[dtype]
    with torch.no_grad():
        x = x.detach()
        if granularity == "tensor":
            return _quantize_tensor(x, dtype, fmax, scale)
        return _quantize_blocks(x, dtype, granularity)[0]


def check_quantize_args(x: Tensor, dtype: torch.dtype, granularity: str, scale) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must be non-empty, got shape {list(x.shape)}")
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype must be one of {list(FP8_MAX)}, got {dtype}")
    unit_shape(tuple(x.shape), granularity)  # validates granularity
    if scale is not None and granularity != "tensor":
        raise ValueError(
            f"a given scale is only allowed for 'tensor' granularity, not {granularity!r}"
        )


def _quantize_tensor(x: Tensor, dtype: torch.dtype, fmax: float, scale) -> tuple:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()  # products below are float32 either way
    amax = _magnitude(*torch.aminmax(x))  # one pass, no |x| copy
    if scale is None:
        unit_scale = _scale_of(amax, fmax)
    else:
        unit_scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if unit_scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {list(unit_scale.shape)}")
        unit_scale = unit_scale.reshape(())
    # float32 products (the 1-D scale takes part in type promotion): x widened into a
    # reused buffer, then scaled in place; a fresh buffer costs its page faults, and a
    # product of two dtypes is converted element by element (both about 2x the work)
    scaled = _scratch(tuple(x.shape), x.device, slot=0).copy_(x)
    scaled.mul_(unit_scale.reshape(1))
    data = _round_to(scaled.clamp_(-fmax, fmax), dtype)
    return data, 1.0 / unit_scale, amax


def _scale_of(amax: Tensor, fmax: float) -> Tensor:
    """``fmax / amax`` per unit, 1 where ``amax == 0``, capped at the float32 maximum."""
    return torch.where(amax > 0, fmax / amax, 1.0).clamp_(max=_FP32_MAX)


def _magnitude(low: Tensor, high: Tensor) -> Tensor:
    """``max(|low|, |high|)`` as float32 (NaN stays NaN; a zero is +0)."""
    return torch.maximum(high, low.neg()).float().abs_()


def unit_dims(shape, granularity: str) -> tuple[int, int]:
    """(rows, columns) of one scaling unit of ``granularity`` on ``shape``."""
    if granularity == "tensor":
        return shape[0], shape[1]
    if granularity == "row":
        return 1, shape[1]
    return (1 if granularity == "1x128" else BLOCK), BLOCK


def _padded_float32(x: Tensor, *units: tuple[int, int], slot: int = 0) -> Tensor:
    """``x`` copied into a float32 scratch buffer (``_scratch``) padded with zeros to
    whole units of each of ``units`` (zeros change no unit's amax and quantize to zero)."""
    m, k = x.shape
    rows = math.lcm(*(r for r, _ in units))
    cols = math.lcm(*(c for _, c in units))
    mp, kp = -(-m // rows) * rows, -(-k // cols) * cols
    buf = _scratch((mp, kp), x.device, slot)
    if kp > k:
        buf[:, k:].zero_()
    if mp > m:
        buf[m:, :k].zero_()
    buf[:m, :k].copy_(x)
    return buf


_SCRATCH = threading.local()
_SCRATCH_MAX = 1 << 26  # 64 MB per slot at most


def _scratch(
    shape: tuple[int, ...], device: torch.device, slot: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A work buffer of ``shape`` and ``dtype``, never returned to a caller. On the CPU it
    is reused from call to call (per thread and ``slot``, up to ``_SCRATCH_MAX`` bytes):
    there a fresh buffer of a few MB costs more in page faults than the arithmetic on it
    (the allocator hands large blocks back to the kernel when they are freed, and each
    page faults in again on first use). Other devices have caching allocators."""
    n = math.prod(shape)
    size = n * dtype.itemsize
    if device.type != "cpu" or size > _SCRATCH_MAX:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    flat = buffers.get(slot)
    if flat is None or flat.numel() < size:
        flat = buffers[slot] = torch.empty(size, dtype=torch.uint8)
    return flat[:size].view(dtype).view(shape)


def _quantize_blocks(
    x: Tensor, dtype: torch.dtype, granularity: str, with_transpose: bool = False
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Row or block quantization of ``x`` (and of ``x.T``, when ``with_transpose``) from
    one zero-padded float32 copy of it: ``|x|`` once, each unit's amax from it by one
    reduction over a 4-D view, then per unit scale, clamp and round (the transpose's
    data is rounded in ``x``'s layout and its bytes transposed: the cheapest transpose)."""
    shape, fmax = x.shape, FP8_MAX[dtype]
    units = [unit_dims(shape, granularity)]
    if with_transpose:  # units of x.T along its rows: columns of x (in 128-row strips)
        units.append((BLOCK, 1) if granularity == "1x128" else (shape[0], 1))
    buf = _padded_float32(x, *units)
    magnitude = torch.abs(buf, out=_scratch(buf.shape, buf.device, slot=1))
    amaxes = [_units_of(magnitude, shape, unit).amax(dim=(1, 3)) for unit in units]
    if with_transpose:  # the scales of both in one go (small tensors: few ops)
        scales = _scale_of(torch.cat([amax.view(-1) for amax in amaxes]), fmax)
        parts = scales.split([amax.numel() for amax in amaxes])
        unit_scales = [part.view(amax.shape) for part, amax in zip(parts, amaxes, strict=True)]
    else:
        unit_scales = [_scale_of(amaxes[0], fmax)]
    out = []
    for i in reversed(range(len(units))):
        # the transpose first: its products overwrite |x|, the others x's copy in place
        unit, unit_scale, scaled = units[i], unit_scales[i], (buf, magnitude)[i]
        per_unit = unit_scale[:, None, :, None]
        torch.mul(_units_of(buf, shape, unit), per_unit, out=_units_of(scaled, shape, unit))
        data = _round_to(scaled[: shape[0], : shape[1]].clamp_(-fmax, fmax), dtype)
        out.append((data, unit_scale.reciprocal(), amaxes[i]))
    if with_transpose:
        data_t, scale_inv_t, amax_t = out.pop(0)
        out.append((data_t.t().contiguous(), *_transposed(scale_inv_t, amax_t)))
    return out


def _round_to(scaled: Tensor, dtype: torch.dtype) -> Tensor:
    """``scaled`` (float32, within the format's range) rounded to ``dtype``, contiguous."""
    return torch.empty(scaled.shape, dtype=dtype, device=scaled.device).copy_(scaled)


def _units_of(buf: Tensor, shape, unit: tuple[int, int]) -> Tensor:
    """The whole ``unit``s (rows x columns) covering the ``shape`` corner of ``buf``, as
    a view ``[units down, rows, units across, columns]``."""
    (m, k), (r, c) = shape, unit
    down, across = -(-m // r), -(-k // c)
    return buf[: down * r, : across * c].unflatten(1, (across, c)).unflatten(0, (down, r))


def fp8_dequantize(
    data: Tensor, scale_inv: Tensor, granularity: str, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of :func:`fp8_quantize`: ``data.float() * scale_inv`` expanded per unit.

    Args:
        data: ``[M, K]`` FP8 tensor.
        scale_inv: float32 with the unit shape of ``granularity`` for ``[M, K]``.
        granularity: one of :data:`GRANULARITIES`.
        out_dtype: dtype of the result (the product is float32, rounded once).

    Returns:
        ``[M, K]`` in ``out_dtype``.
    """
    check_dequantize_args(data, scale_inv, granularity)
    shape = (data.shape[0], data.shape[1])
    values, factor = _fp8_values(data)
    per_unit = scale_inv.float() * factor
    if granularity == "tensor":
        wide = values.float()
        torch.mul(wide, per_unit.reshape(1), out=wide)  # float32 products, rounded once below
        return wide.to(out_dtype)
    (m, k), unit = shape, unit_dims(shape, granularity)
    wide = _padded_float32(values, unit)  # float16 to float32: vectorised
    _units_of(wide, shape, unit).mul_(per_unit[:, None, :, None])
    return torch.empty(shape, dtype=out_dtype, device=data.device).copy_(wide[:m, :k])


def check_dequantize_args(data: Tensor, scale_inv: Tensor, granularity: str) -> None:
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D [M, K], got shape {list(data.shape)}")
    shape = (data.shape[0], data.shape[1])
    expected = unit_shape(shape, granularity)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for {granularity!r} on {list(shape)} must have shape "
            f"{list(expected)}, got {list(scale_inv.shape)}"
        )


def _fp8_values(data: Tensor) -> tuple[Tensor, float]:
    """``(values, factor)`` with ``values.float() * factor == data.float()`` exactly;
    on the CPU ``values`` is a scratch buffer, overwritten by the next call.

    torch converts FP8 to wider types on the CPU one element at a time (about 4 ns an
    element on an AVX-512 Xeon, eight times the other direction), which made the
    fallback matmul of FP8 GEMMs slower than the GEMM. On the CPU the bytes become
    float16 bit patterns through integer operations instead, and float16 to float32 is
    vectorised (about 15x faster):

    * an E5M2 byte is the upper byte of the float16 of the same value (same exponent
      bias, 2 of float16's 10 mantissa bits), infinities and NaN included: factor 1;
    * an E4M3 byte's 7 exponent-and-mantissa bits placed at float16 bits 7-13 (the sign
      at bit 15) are the float16 of ``value * 2**-8``, normal and subnormal values alike
      (E4M3's bias is 7, float16's 15, and float16 spaces its subnormals like its
      lowest normal binade): factor ``2**8``, an exact scaling. The E4M3 NaN
      (``S.1111.111``) becomes a float16 NaN.
    """
    if data.device.type != "cpu" or data.dtype not in FP8_MAX:
        return data.float(), 1.0
    bits = _scratch(data.shape, data.device, slot=2, dtype=torch.int16)  # a temporary
    if data.dtype == torch.float8_e5m2:
        bits.copy_(data.view(torch.uint8))
        bits <<= 8
        return bits.view(torch.float16), 1.0
    bits.copy_(data.view(torch.int8))  # sign-extended: bits 8-15 = the sign
    bits <<= 7  # exponent and mantissa at bits 7-13; the sign at bits 14 and 15
    bits &= ~0x4000  # the sign at bit 15 only
    # A NaN (S.1111.111, only from a NaN input: quantizing saturates) is the largest
    # byte read as int8 (+NaN, 0x7F) or as uint8 (-NaN, 0xFF).
    if int(data.view(torch.int8).max()) == 0x7F or int(data.view(torch.uint8).max()) == 0xFF:
        bits[(data.view(torch.uint8) & 0x7F) == 0x7F] = 0x7E00
    return bits.view(torch.float16), 256.0


def fp8_quantize_transpose(
    x: Tensor, dtype: torch.dtype, granularity: str, scale: Tensor | float | None = None
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    """Quantise ``x`` and ``x.T`` together, each along its own last dimension.

    A linear layer needs its activation (and output gradient) quantised along K
    for the forward GEMM and along M for the weight-gradient GEMM, which the TN
    convention of scaled matmuls takes as the transposed tensor quantised along
    its rows. A kernel reads ``x`` once and writes both; the spec is simply::

        (fp8_quantize(x, ...), fp8_quantize(x.T.contiguous(), ...))

    so "row" and "1x128" units of the transpose are columns (and 128x1 strips) of
    ``x``, while "tensor" and "128x128" units are the same elements as in ``x``
    (the transpose's ``scale_inv`` is the first one's, transposed).

    Args:
        x: ``[M, K]``, any floating dtype, non-empty.
        dtype, granularity, scale: as in :func:`fp8_quantize` (``scale`` only for
            ``"tensor"``, used for both).

    Returns:
        ``((data, scale_inv, amax), (data_t, scale_inv_t, amax_t))`` with
        ``data`` ``[M, K]`` and ``data_t`` ``[K, M]`` contiguous, unit shapes as in
        :func:`fp8_quantize` for ``[M, K]`` and ``[K, M]``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    if granularity in ("tensor", "128x128"):  # the transpose's units are the same elements
        data, scale_inv, amax = fp8_quantize(x, dtype, granularity, scale)
        return (data, scale_inv, amax), (data.t().contiguous(), *_transposed(scale_inv, amax))
    check_quantize_args(x, dtype, granularity, scale)
    with torch.no_grad():
        first, second = _quantize_blocks(x.detach(), dtype, granularity, with_transpose=True)
        return first, second


def _transposed(*units: Tensor) -> tuple[Tensor, ...]:
    return tuple(u.t().contiguous() if u.dim() == 2 else u for u in units)
