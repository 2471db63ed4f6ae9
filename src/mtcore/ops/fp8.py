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

import torch
from torch import Tensor

FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,  # 57344
}
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "1x128", "128x128")
BLOCK = 128
_FP32_MAX = torch.finfo(torch.float32).max


def _unit_shape(shape: tuple[int, int], granularity: str) -> tuple[int, ...]:
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


def _unit_amax(x: Tensor, granularity: str) -> Tensor:
    """``max |x|`` over each scaling unit, in float32 (exact: a max rounds nothing).

    From each unit's minimum and maximum, without a ``|x|`` copy: the whole tensor's
    from ``torch.aminmax`` (one pass); rows and blocks, of a float32 ``x``, from
    ``amin`` and ``amax`` over views of it, a partial last block taken on its own (on
    the CPU ``aminmax`` along a short last dimension does not vectorise: 0.8 ms for the
    1x128 blocks of ``[512, 640]`` against 0.08 ms for ``amin`` and ``amax``)."""
    m, k = x.shape
    if granularity == "tensor":
        return _magnitude(*torch.aminmax(x))
    if granularity == "row":
        return _magnitude(x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True))
    full = k // BLOCK
    parts = []
    if full:
        blocks = x[:, : full * BLOCK].view(m, full, BLOCK)
        parts.append(_magnitude(blocks.amin(dim=2), blocks.amax(dim=2)))
    if k % BLOCK:
        rest = x[:, full * BLOCK :]
        parts.append(_magnitude(rest.amin(dim=1, keepdim=True), rest.amax(dim=1, keepdim=True)))
    per_strip = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [M, ceil(K/128)]
    if granularity == "1x128":
        return per_strip
    return torch.stack([rows.amax(dim=0) for rows in per_strip.split(BLOCK)])  # 128x128


def _magnitude(low: Tensor, high: Tensor) -> Tensor:
    """``max(|low|, |high|)`` as float32 (NaN stays NaN; a zero is +0)."""
    return torch.maximum(high, low.neg()).float().abs_()


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
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"x must be non-empty, got shape {list(x.shape)}")
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype must be one of {list(FP8_MAX)}, got {dtype}")
    _unit_shape(tuple(x.shape), granularity)  # validates granularity
    if scale is not None and granularity != "tensor":
        raise ValueError(
            f"a given scale is only allowed for 'tensor' granularity, not {granularity!r}"
        )
    fmax = FP8_MAX[dtype]

    with torch.no_grad():
        x = x.detach()
        if granularity == "tensor":
            if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                x = x.float()  # products below are float32 either way
            scaled = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        else:  # float32 x, scaled in place: no mixed-dtype products (cast element by element)
            x = scaled = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
        amax = _unit_amax(x, granularity)
        if scale is None:
            unit_scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
            unit_scale = unit_scale.clamp(max=_FP32_MAX)
        else:
            unit_scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
            if unit_scale.numel() != 1:
                raise ValueError(f"scale must have one element, got shape {list(unit_scale.shape)}")
            unit_scale = unit_scale.reshape(())
        _scale_units(x, unit_scale, granularity, scaled)
        data = scaled.clamp_(-fmax, fmax).to(dtype)
        return data, 1.0 / unit_scale, amax


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
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D [M, K], got shape {list(data.shape)}")
    shape = (data.shape[0], data.shape[1])
    expected = _unit_shape(shape, granularity)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for {granularity!r} on {list(shape)} must have shape "
            f"{list(expected)}, got {list(scale_inv.shape)}"
        )
    values, factor = _fp8_values(data)
    # float32 products in place, rounded once to out_dtype: the bits a mixed-dtype
    # multiply into out_dtype gives, but vectorised (torch casts mixed dtypes element
    # by element on the CPU).
    wide = values.float()
    _scale_units(wide, scale_inv.float() * factor, granularity, wide)
    return wide.to(out_dtype)


def _scale_units(values: Tensor, per_unit: Tensor, granularity: str, out: Tensor) -> None:
    """``out = values * per_unit`` expanded per unit: the product in float32, rounded
    once to ``out``'s dtype. Blocks are views of ``values`` (no expanded scale tensor)."""
    if granularity == "tensor":
        torch.mul(values, per_unit.reshape(1), out=out)  # 1-D: float32 products, not values'
        return
    if granularity == "row":
        torch.mul(values, per_unit, out=out)
        return
    if granularity == "1x128":
        _scale_column_blocks(values, per_unit, out)
        return
    for block_row, start in enumerate(range(0, values.shape[0], BLOCK)):  # 128x128
        rows = slice(start, start + BLOCK)
        _scale_column_blocks(values[rows], per_unit[block_row : block_row + 1], out[rows])


def _scale_column_blocks(values: Tensor, per_block: Tensor, out: Tensor) -> None:
    """``out = values * per_block`` with one scale per 128 columns (``per_block``
    ``[rows or 1, ceil(K / 128)]``); the last block may be partial."""
    m, k = values.shape
    full = k // BLOCK
    if full:
        cols = full * BLOCK
        torch.mul(
            values[:, :cols].view(m, full, BLOCK),
            per_block[:, :full, None],
            out=out[:, :cols].view(m, full, BLOCK),
        )
    if k % BLOCK:
        torch.mul(values[:, full * BLOCK :], per_block[:, full:], out=out[:, full * BLOCK :])


def _fp8_values(data: Tensor) -> tuple[Tensor, float]:
    """``(values, factor)`` with ``values.float() * factor == data.float()`` exactly.

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
    if data.dtype == torch.float8_e5m2:
        bits = data.view(torch.uint8).to(torch.int16)
        bits <<= 8
        return bits.view(torch.float16), 1.0
    bits = data.view(torch.int8).to(torch.int16)  # sign-extended: bits 8-15 = the sign
    bits <<= 7  # exponent and mantissa at bits 7-13; the sign at bits 14 and 15
    bits &= ~0x4000  # the sign at bit 15 only
    magnitude = data.view(torch.uint8) & 0x7F
    if int(magnitude.max()) == 0x7F:  # a NaN, only from a NaN input (quantizing saturates)
        bits[magnitude == 0x7F] = 0x7E00
    return bits.view(torch.float16), 256.0


def fp8_widen(data: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``data.to(dtype)`` of an E4M3 or E5M2 tensor, bit for bit (NaN included), fast on
    the CPU (see ``_fp8_values``). ``dtype``: float32 or bfloat16; both hold every FP8
    value, and the sums of their products in a GEMM (float16 overflows there)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    values, factor = _fp8_values(data)
    if dtype == torch.float32:
        wide = values.float()
        return wide if factor == 1.0 else wide.mul_(factor)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    return torch.mul(values, factor, out=out)  # exact: FP8 values fit float16 too


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
    return fp8_quantize(x, dtype, granularity, scale), fp8_quantize(
        x.t().contiguous(), dtype, granularity, scale
    )
