"""FP8 contract: quantize/dequantize round trip per granularity, scaled matmul per pair.

Round trip: every element within half an FP8 step of its value, the FP8
format's bound (``2**-(m+1) * |x|`` for normals, half the smallest subnormal,
times ``scale_inv``, below). Scaled matmul: relative Frobenius error against
the float32 matmul of the unquantized operands within ``MATMUL_BOUND``, and
against the float32 matmul of the dequantized operands within
``DEQUANT_BOUND`` (which is what a correct native path computes).

The scaled matmul runs on every operand granularity pair a backend can be asked
for (``matmul_pairs``): each granularity with itself, the pairs mtcore's FP8
recipes multiply (blockwise: 1x128 activations and gradients x 128x128
weights), and every pair the backend declares native. A declared pair takes
``torch._scaled_mm`` (``FP8.scaled_matmul``), so a claim the device cannot
honour fails here, not at step 1 of FP8 training.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.ops import GRANULARITIES, fp8_dequantize, fp8_quantize
from mtcore.testing.conformance.plugin import CAPABILITY, kit_backend

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}
ROUND_TRIP_SHAPES = ((37, 300), (256, 128), (1, 1))
# (a format, b format) -> bound on |out - a @ b.T| / |a @ b.T|, Frobenius norms.
MATMUL_BOUND = {("e4m3", "e4m3"): 0.08, ("e5m2", "e4m3"): 0.15}
DEQUANT_BOUND = 2e-3
M, N, K = 160, 48, 256  # multiples of 16 (native kernels' rule); blocks partial in M and N
# (a, b) pairs that mtcore.precision's recipes multiply besides a granularity with
# itself: blockwise scaling's forward and dgrad GEMMs (1x128 x 128x128).
RECIPE_PAIRS = (("1x128", "128x128"),)


def matmul_pairs(fp8) -> list[tuple[str, str]]:
    """Every pair the kit multiplies on ``fp8``: the fixed ones, then the declared native ones."""
    pairs = [(g, g) for g in GRANULARITIES] + list(RECIPE_PAIRS)
    return pairs + sorted(set(fp8.native_granularities) - set(pairs))


def _pair_id(pair: tuple[str, str]) -> str:
    a, b = pair
    return a if a == b else f"{a}-{b}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pair" in metafunc.fixturenames:
        pairs = matmul_pairs(kit_backend(metafunc.config).fp8)
        metafunc.parametrize("pair", pairs, ids=[_pair_id(p) for p in pairs])
    if "native_pair" in metafunc.fixturenames:  # only the pairs that take torch._scaled_mm
        pairs = sorted(kit_backend(metafunc.config).fp8.native_granularities)
        metafunc.parametrize("native_pair", pairs, ids=[_pair_id(p) for p in pairs])


@pytest.fixture(autouse=True)
def _fp8_available(backend):
    available = backend.fp8.availability()
    if not available:
        pytest.skip(f"{CAPABILITY} FP8 is not available on {backend.name}: {available.reason}")


def _randn(seed, *shape, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_round_trip(backend, device, granularity, fmt):
    dtype = FORMATS[fmt]
    half_step = 2.0 ** -(_MANTISSA[dtype] + 1)
    for i, shape in enumerate(ROUND_TRIP_SHAPES):
        x = _randn(500 + i, *shape, device=device) * 3.0
        x[0, : min(5, shape[1])] *= 1e-4  # values far below amax land in the subnormals
        q = backend.fp8.quantize(x, dtype, granularity)
        _, ref_scale_inv, ref_amax = fp8_quantize(x.cpu(), dtype, granularity)
        where = f"{granularity} {fmt} {list(shape)}"
        assert q.data.dtype == dtype and tuple(q.data.shape) == shape, (
            f"{where}: data {q.data.dtype} {list(q.data.shape)}"
        )
        assert q.scale_inv.shape == ref_scale_inv.shape, (
            f"{where}: scale_inv shape {list(q.scale_inv.shape)}"
        )
        assert torch.equal(q.amax.float().cpu(), ref_amax), (
            f"{where}: amax differs from max |x| per scaling unit"
        )
        # Scales are float32 and the reference's: a path rounding them (to bfloat16, say)
        # round-trips within its own scales but multiplies every GEMM by the rounding.
        assert q.scale_inv.dtype == torch.float32 and q.amax.dtype == torch.float32, (
            f"{where}: scale_inv {q.scale_inv.dtype}, amax {q.amax.dtype}; both must be float32"
        )
        rel = (q.scale_inv.cpu() - ref_scale_inv).abs() / ref_scale_inv.abs().clamp_min(1e-30)
        assert rel.max().item() <= 2.4e-7, (
            f"{where}: scale_inv off the reference's by {rel.max().item():.3g} (relative)"
        )
        y = q.dequantize(torch.float32).cpu()
        xs = x.float().cpu()
        per_elem_scale_inv = fp8_dequantize(
            torch.ones(shape).to(dtype), q.scale_inv.float().cpu(), granularity
        )
        bound = (half_step * xs.abs() + 0.5 * _MIN_SUBNORMAL[dtype] * per_elem_scale_inv) * (
            1 + 1e-6
        ) + 1e-30
        err = (y - xs).abs()
        assert torch.isfinite(y).all(), f"{where}: dequantized values are not finite"
        worst = int((err - bound).argmax())
        assert (err <= bound).all(), (
            f"{where}: {int((err > bound).sum())} elements beyond half an FP8 step; worst "
            f"x={xs.flatten()[worst].item():.6g} -> {y.flatten()[worst].item():.6g}"
        )


@pytest.mark.parametrize("formats", list(MATMUL_BOUND), ids=lambda f: f"{f[0]}x{f[1]}")
def test_scaled_matmul(backend, device, kit, pair, formats):
    fp8 = backend.fp8
    label = pair[0] if pair[0] == pair[1] else f"{pair[0]} x {pair[1]}"
    a = _randn(600, M, K, device=device)
    b = _randn(601, N, K, device=device)
    qa = qb = None
    try:
        qa = fp8.quantize(a, FORMATS[formats[0]], pair[0])
        qb = fp8.quantize(b, FORMATS[formats[1]], pair[1])
        path = "native" if fp8.takes_natively(qa, qb) else "fallback"
        out = fp8.scaled_matmul(qa, qb, out_dtype=torch.float32)
    except Exception as exc:
        path = "native" if qb is not None and fp8.takes_natively(qa, qb) else "fallback"
        where = f"scaled_matmul {label} {formats[0]}x{formats[1]} ({path} path)"
        claim = (
            f"{backend.name} declares {pair[0]} x {pair[1]} ({formats[0]} x {formats[1]}) "
            "native, so FP8.scaled_matmul hands it to torch._scaled_mm; declare only pairs "
            "and formats the device runs"
            if path == "native"
            else "the fallback matmul must serve every pair"
        )
        raise AssertionError(f"{where}: {claim}; it raised {exc!r}") from exc
    where = f"scaled_matmul {label} {formats[0]}x{formats[1]} ({path} path)"
    assert out.dtype == torch.float32 and tuple(out.shape) == (M, N), (
        f"{where}: got {out.dtype} {list(out.shape)}"
    )
    ref = (a.float().cpu() @ b.float().cpu().t()).double()
    deq = qa.dequantize().cpu().double() @ qb.dequantize().cpu().double().t()
    got = out.cpu().double()
    err = ((got - ref).norm() / ref.norm()).item()
    err_deq = ((got - deq).norm() / deq.norm()).item()
    bound = MATMUL_BOUND[formats]
    kit.note(
        "fp8",
        f"scaled_matmul {label:<16} {formats[0]}x{formats[1]}: {path}, relative error {err:.3f} (bound {bound})",
    )
    assert err_deq <= DEQUANT_BOUND, (
        f"{where}: relative error {err_deq:.3g} against the product of the dequantized operands "
        f"(bound {DEQUANT_BOUND}); scales are applied wrongly"
    )
    assert err <= bound, (
        f"{where}: relative error {err:.3g} against the float32 matmul (bound {bound})"
    )


# The rounding of the output on top of DEQUANT_BOUND: bfloat16 keeps 8 significant bits,
# float16 11 (a Frobenius error of about the unit roundoff, 2**-9 and 2**-12).
LOW_PRECISION_OUT = {
    torch.bfloat16: DEQUANT_BOUND + 2.0**-8,
    torch.float16: DEQUANT_BOUND + 2.0**-11,
}


@pytest.mark.parametrize("out_dtype", list(LOW_PRECISION_OUT), ids=str)
def test_scaled_matmul_into_low_precision(backend, device, pair, out_dtype):
    """The product in the dtype training asks for (bf16 or fp16 activations): of that dtype,
    and the product of the dequantized operands up to that dtype's rounding; a path that
    drops the scales when it narrows the output fails here."""
    fp8 = backend.fp8
    a = _randn(610, M, K, device=device) * 30.0  # scales far from 1: dropping them shows
    b = _randn(611, N, K, device=device) / 20.0
    qa = fp8.quantize(a, FORMATS["e4m3"], pair[0])
    qb = fp8.quantize(b, FORMATS["e4m3"], pair[1])
    out = fp8.scaled_matmul(qa, qb, out_dtype=out_dtype)
    where = f"scaled_matmul {pair[0]} x {pair[1]} into {str(out_dtype).removeprefix('torch.')}"
    assert out.dtype == out_dtype, f"{where}: got {out.dtype}"
    deq = qa.dequantize().cpu().double() @ qb.dequantize().cpu().double().t()
    err = ((out.cpu().double() - deq).norm() / deq.norm()).item()
    assert err <= LOW_PRECISION_OUT[out_dtype], (
        f"{where}: relative error {err:.3g} against the dequantized product "
        f"(bound {LOW_PRECISION_OUT[out_dtype]:.3g}): scales applied wrongly, or lost"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_with_a_scale_at_the_formats_max(backend, device, fmt):
    """Delayed scaling with a scale that puts max|x| at 1.25x the format's max: the top
    values saturate at the max (448 for e4m3, 57344 for e5m2), the rest keep their
    values within half an FP8 step (one saturating at 240 passed a case peaking near 92)."""
    dtype = FORMATS[fmt]
    x = _randn(520, 64, 96, device=device)
    fmax = backend.fp8.max_value(dtype)
    scale = torch.tensor(1.25 * fmax / x.abs().max().item())
    q = backend.fp8.quantize(x, dtype, "tensor", scale.to(device))
    want, _, _ = fp8_quantize(x.cpu(), dtype, "tensor", scale)
    got, ref = q.data.float().cpu(), want.float()
    assert got.abs().max().item() == fmax, (
        f"{fmt}: saturated values are {got.abs().max().item():g}, expected the format's max {fmax:g}"
    )
    step = ref.abs() * 2.0 ** -_MANTISSA[dtype] + _MIN_SUBNORMAL[dtype]
    bad = (got - ref).abs() > step
    assert not bad.any(), (
        f"{fmt}: {int(bad.sum())} of {ref.numel()} values more than one FP8 step from the "
        f"reference's near the max; worst got {got[bad].flatten()[0].item():g}, reference "
        f"{ref[bad].flatten()[0].item():g}"
    )


def test_native_matmul_speed(backend, device, native_pair):
    """A pair taken natively must not be far slower than the fallback matmul on the same
    operands (``kernel_timing``: 10x and 50 ms): a declared-native path at 300 s a step
    passed every numerical check."""
    from mtcore.backend.checks import kernel_timing
    from mtcore.backend.fp8 import fallback_scaled_matmul

    fp8, pair = backend.fp8, native_pair
    qa = fp8.quantize(_randn(600, M, K, device=device), FORMATS["e4m3"], pair[0])
    qb = fp8.quantize(_randn(601, N, K, device=device), FORMATS["e4m3"], pair[1])
    if not fp8.takes_natively(qa, qb):
        pytest.skip(f"{CAPABILITY} {_pair_id(pair)} takes the fallback for the kit's shapes")
    try:
        fp8.scaled_matmul(qa, qb, out_dtype=torch.float32)
    except Exception as exc:  # test_scaled_matmul fails it and says why
        pytest.skip(f"the native path raises ({type(exc).__name__}): see test_scaled_matmul")
    calls = {
        "reference": lambda: fallback_scaled_matmul(qa, qb, torch.float32),
        "kernel": lambda: fp8.scaled_matmul(qa, qb, out_dtype=torch.float32),
    }
    slow = kernel_timing.too_slow(
        calls, backend.device.synchronize, kernel_timing.NATIVE_MATMUL_SLACK_S
    )
    assert slow is None, (
        f"scaled_matmul {_pair_id(pair)} (native path): {slow[0] * 1e3:.3g} ms against the "
        f"fallback matmul's {slow[1] * 1e3:.3g} ms on the same operands (the bound is "
        f"{kernel_timing.SLOWER_BOUND:g}x + {kernel_timing.NATIVE_MATMUL_SLACK_S * 1e3:g} ms): "
        "declare native only the pairs the device runs fast (or pass FP8 a choose)"
    )
