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


def _unit_amax(x_abs: Tensor, granularity: str) -> Tensor:
    """Max over each scaling unit; zero padding of partial blocks cannot raise a max of |x|."""
    m, k = x_abs.shape
    if granularity == "tensor":
        return x_abs.amax()
    if granularity == "row":
        return x_abs.amax(dim=1, keepdim=True)
    mb, kb = math.ceil(m / BLOCK), math.ceil(k / BLOCK)
    if granularity == "1x128":
        padded = torch.nn.functional.pad(x_abs, (0, kb * BLOCK - k))
        return padded.view(m, kb, BLOCK).amax(dim=2)
    padded = torch.nn.functional.pad(x_abs, (0, kb * BLOCK - k, 0, mb * BLOCK - m))
    return padded.view(mb, BLOCK, kb, BLOCK).amax(dim=(1, 3))


def _expand(per_unit: Tensor, shape: tuple[int, int], granularity: str) -> Tensor:
    """Broadcast one value per unit to one value per element of an ``[M, K]`` tensor."""
    m, k = shape
    if granularity in ("tensor", "row"):
        return per_unit.expand(m, k)
    if granularity == "1x128":
        return per_unit.repeat_interleave(BLOCK, dim=1)[:, :k]
    full = per_unit.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return full[:m, :k]


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
        xf = x.detach().float()
        amax = _unit_amax(xf.abs(), granularity)
        if scale is None:
            unit_scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
            unit_scale = unit_scale.clamp(max=_FP32_MAX)
        else:
            unit_scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
            if unit_scale.numel() != 1:
                raise ValueError(f"scale must have one element, got shape {list(unit_scale.shape)}")
            unit_scale = unit_scale.reshape(())
        scaled = xf * _expand(unit_scale, tuple(x.shape), granularity)
        data = scaled.clamp(-fmax, fmax).to(dtype)
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
    return (data.float() * _expand(scale_inv.float(), shape, granularity)).to(out_dtype)


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
