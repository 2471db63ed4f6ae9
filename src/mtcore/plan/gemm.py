"""A measured GEMM-shape efficiency table: how fast a matrix product of a given shape runs.

A hardware file may carry, per dtype, the achieved fraction of that dtype's peak for
products it measured (``benchmarks/bench_gemm_shapes.py`` prints one in this form)::

    [gemm_efficiency.bf16]
    "4096x2048x6144" = 0.71     # M x K x N: [M, K] @ [K, N]

A product of a measured shape gets its own fraction; any other is interpolated
linearly in the logarithm of its FLOPs (2 M K N) between the two measured products
nearest in size (their mean where several share a size), and held at the end
values outside the measured range. A product's input- and weight-gradient
passes have its FLOPs, so they get its fraction. Without a table for the dtype the
planner credits the single fitted ``GEMM_EFFICIENCY`` (``timing.gemm_flops``) and says
so in a note.
"""

from __future__ import annotations

import bisect
import math
from functools import cache


def parse_shape(key: str) -> tuple[int, int, int]:
    """``"4096x2048x6144"`` -> (4096, 2048, 6144); ValueError for anything else."""
    parts = key.lower().split("x")
    if len(parts) != 3 or not all(
        p.strip().isascii() and p.strip().isdigit() and int(p) > 0 for p in parts
    ):
        raise ValueError(f"GEMM shape {key!r} must be MxKxN with positive whole numbers")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def check_table(table, peaks) -> None:
    """Raise ``TypeError`` naming the entry of a ``gemm_efficiency`` table that is not a
    ``dtype -> {"MxKxN": fraction in (0, 1]}`` entry for a dtype the file has a peak for."""
    if not isinstance(table, dict):
        raise TypeError("gemm_efficiency must be a table of dtype tables")
    for dtype, shapes in table.items():
        if dtype not in peaks:
            raise TypeError(f"gemm_efficiency.{dtype}: the file gives no {dtype} peak")
        if not isinstance(shapes, dict) or not shapes:
            raise TypeError(f'gemm_efficiency.{dtype} must be a table of "MxKxN" = fraction')
        for key, value in shapes.items():
            try:
                parse_shape(key)
            except ValueError as e:
                raise TypeError(f"gemm_efficiency.{dtype}: {e}") from None
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not 0 < value <= 1:
                raise TypeError(
                    f"gemm_efficiency.{dtype}.{key} must be a fraction of peak in (0, 1], "
                    f"not {value!r}"
                )


def _points(shapes: dict[str, float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(log FLOPs, fraction) sorted by size; products of one size share their mean."""
    by_size: dict[float, list[float]] = {}
    for key, fraction in shapes.items():
        m, k, n = parse_shape(key)
        by_size.setdefault(math.log(2.0 * m * k * n), []).append(fraction)
    sizes = sorted(by_size)
    return tuple(sizes), tuple(sum(by_size[s]) / len(by_size[s]) for s in sizes)


@cache
def _curve(items: tuple[tuple[str, float], ...]):
    return _points(dict(items))


def efficiency(
    shapes: dict[str, float], flops: float, shape: tuple[int, int, int] | None = None
) -> float:
    """The fraction of peak a product of ``flops`` FLOPs (``shape``, when known) achieves
    by the table ``shapes``: its own entry when measured, else interpolated in log FLOPs."""
    if shape is not None:
        exact = shapes.get("x".join(str(d) for d in shape))
        if exact is not None:
            return exact
    sizes, fractions = _curve(tuple(sorted(shapes.items())))
    x = math.log(max(flops, 1.0))
    i = bisect.bisect_left(sizes, x)
    if i == 0:
        return fractions[0]
    if i == len(sizes):
        return fractions[-1]
    lo, hi = sizes[i - 1], sizes[i]
    share = (x - lo) / (hi - lo)
    return fractions[i - 1] + share * (fractions[i] - fractions[i - 1])
