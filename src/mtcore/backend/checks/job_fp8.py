"""The FP8 path a job's recipe takes, checked against the reference before step 1.

An FP8 linear quantizes its operands with the backend's ``FP8.quantize`` and
multiplies them with ``FP8.scaled_matmul``; both are the backend's to override, and
the kit's bounds on the product are loose enough (8% against float32) that a path
rounding its scales to bfloat16, or dropping them when it narrows the output, trains
with wrong losses. So for each GEMM of the recipe (``FP8Gemm``: the operands' formats
and granularities), at the job's output dtypes, this checks:

* ``quantize``: ``scale_inv`` and ``amax`` float32 and equal to the reference op's
  (``mtcore.ops.fp8_quantize``), data within one FP8 step of it; with a given scale
  (delayed scaling) that puts the largest values at the format's maximum and beyond
  (they must saturate there, not below it);
* ``scaled_matmul``: the product of the reference's dequantized operands within
  ``DEQUANT_BOUND`` (Frobenius) plus the output dtype's rounding; operands scaled far
  from 1 (x30, /20) so that a path ignoring its scales is off by orders of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtcore.ops import FP8_MAX, fp8_dequantize, fp8_quantize

DEQUANT_BOUND = 2e-3
_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
M, N, K = 96, 48, 256  # multiples of 16 (native GEMMs' rule); 128-blocks partial in M, N


@dataclass(frozen=True)
class FP8Gemm:
    """One GEMM of a recipe: ``a @ b.T`` with each operand's FP8 format and granularity."""

    name: str  # forward, dgrad, wgrad
    a: tuple[torch.dtype, str]
    b: tuple[torch.dtype, str]


def _short(dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def _quantize_problem(fp8, x, fmt, gran, scale=None) -> str | None:
    got = fp8.quantize(x, fmt, gran, scale)
    data, scale_inv, amax = fp8_quantize(x.cpu(), fmt, gran, None if scale is None else scale.cpu())
    if got.scale_inv.dtype != torch.float32 or got.amax.dtype != torch.float32:
        return f"scale_inv {got.scale_inv.dtype}, amax {got.amax.dtype}; both must be float32"
    if not torch.equal(got.amax.cpu(), amax):
        return "amax differs from the reference's max |x| per scaling unit"
    rel = ((got.scale_inv.cpu() - scale_inv).abs() / scale_inv.abs().clamp_min(1e-30)).max()
    if rel.item() > 2.4e-7:
        return f"scale_inv off the reference's by {rel.item():.2g} (relative)"
    g, w = got.data.cpu().float(), data.float()
    step = w.abs() * 2.0 ** -(2 if fmt is torch.float8_e5m2 else 3) + 2.0**-9
    if got.data.dtype != fmt or ((g - w).abs() > step).any():
        worst = int((g - w).abs().argmax())
        return (
            f"data more than one FP8 step off the reference (got {g.flatten()[worst].item():g}, "
            f"reference {w.flatten()[worst].item():g}; the format's max is {FP8_MAX[fmt]:g})"
        )
    return None


def check_fp8(fp8, gemms: list[FP8Gemm], out_dtypes, delayed: bool, device) -> list[str]:
    """What is wrong with ``fp8``'s quantize and scaled matmul for these GEMMs."""
    problems: list[str] = []
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(M, K, generator=g) * 30.0).to(device)
    b = (torch.randn(N, K, generator=g) / 20.0).to(device)
    seen: set = set()
    for gemm in gemms:
        for (fmt, gran), x in ((gemm.a, a), (gemm.b, b)):
            if (fmt, gran) in seen:
                continue
            seen.add((fmt, gran))
            where = f"FP8 quantize {_short(fmt)} {gran}"
            try:
                wrong = _quantize_problem(fp8, x, fmt, gran)
                if wrong is None and delayed and gran == "tensor":
                    # A scale that puts max|x| at 1.25x the format's max: the top values
                    # saturate at the max, those just below it must keep their values.
                    scale = torch.tensor(1.25 * FP8_MAX[fmt] / x.abs().max().item())
                    wrong = _quantize_problem(fp8, x, fmt, gran, scale.to(device))
                    where += " with a given scale (delayed scaling, values at the max)"
            except Exception as e:  # a path that raises fails the check too
                wrong = f"raised {type(e).__name__}: {e}"
            if wrong:
                problems.append(f"{where}: {wrong}")
        for out_dtype in out_dtypes:
            where = (
                f"FP8 scaled_matmul {gemm.name} ({_short(gemm.a[0])} {gemm.a[1]} x "
                f"{_short(gemm.b[0])} {gemm.b[1]}) into {_short(out_dtype)}"
            )
            try:
                qa, qb = fp8.quantize(a, *gemm.a), fp8.quantize(b, *gemm.b)
                out = fp8.scaled_matmul(qa, qb, out_dtype=out_dtype)
            except Exception as e:  # a path that raises fails too
                problems.append(f"{where}: raised {type(e).__name__}: {e}")
                continue
            ra = fp8_quantize(a.cpu(), *gemm.a)
            rb = fp8_quantize(b.cpu(), *gemm.b)
            want = (
                fp8_dequantize(ra[0], ra[1], gemm.a[1]).double()
                @ fp8_dequantize(rb[0], rb[1], gemm.b[1]).double().t()
            )
            if out.dtype != out_dtype or tuple(out.shape) != (M, N):
                problems.append(f"{where}: got {out.dtype} {list(out.shape)}")
                continue
            err = ((out.cpu().double() - want).norm() / want.norm()).item()
            bound = DEQUANT_BOUND + _ROUNDING.get(out_dtype, 2.0**-8)
            if not err <= bound:
                problems.append(
                    f"{where}: relative error {err:.3g} against the reference's dequantized "
                    f"product (bound {bound:.3g}): scales applied wrongly, rounded, or lost"
                )
    return problems
