"""The host CPU's FP8 kernels in C give the reference ops' bits, and build once per machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mtcore import ops
from mtcore.backend import KernelQuery, host_fp8, select_backend
from mtcore.backend.host import cpu_identity

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module", autouse=True)
def library():
    assert host_fp8.load(cpu_identity()), host_fp8.unavailable_reason()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in FORMATS else t


def _assert_same(got: tuple, want: tuple, where: str) -> None:
    for name, g, w in zip(("data", "scale_inv", "amax"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{where}: {name} {g.shape} {g.dtype}"
        assert g.is_contiguous(), f"{where}: {name} not contiguous"
        assert torch.equal(_bytes(g), _bytes(w)), f"{where}: {name} differs"


def _inputs() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    # magnitudes from float32 subnormals to 1e30 across the columns: denormal amaxes
    # (scale capped at the float32 maximum), underflow to FP8 subnormals and zero
    spread = torch.randn(130, 300, generator=g) * torch.logspace(-40, 30, 300)
    blocky = torch.randn(257, 129, generator=g) * 3
    blocky[:128, :] = 0.0  # whole zero units: scale 1
    blocky[200] = 0.0
    return [("spread", spread), ("blocky", blocky), ("one", torch.randn(1, 1, generator=g))]


@pytest.mark.parametrize("granularity", ops.GRANULARITIES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_quantize_gives_the_reference_bits(granularity, x_dtype):
    for label, x in _inputs():
        x = x.to(x_dtype)
        scales = [None, 7.5, torch.tensor([0.3])] if granularity == "tensor" else [None]
        for fmt in FORMATS:
            for scale in scales:
                where = f"{label} {fmt} {granularity} scale={scale}"
                _assert_same(
                    host_fp8.fp8_quantize(x, fmt, granularity, scale),
                    ops.fp8_quantize(x, fmt, granularity, scale),
                    where,
                )
                got, got_t = host_fp8.fp8_quantize_transpose(x, fmt, granularity, scale)
                want, want_t = ops.fp8_quantize_transpose(x, fmt, granularity, scale)
                _assert_same(got, want, where)
                _assert_same(got_t, want_t, f"{where} (transpose)")


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_ties_and_subnormals_round_to_nearest_even(fmt):
    """Every FP8 value, the midpoints between neighbours (ties) and points just off
    them, quantized with a given scale of 1: the reference's bits (torch's conversion)."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    values = values[values.isfinite() & (values.abs() <= ops.FP8_MAX[fmt])].unique()
    middle = (values[1:] + values[:-1]) / 2
    ulp = middle.abs() * 2.0**-20 + 2.0**-40
    x = torch.cat([values, middle, middle + ulp, middle - ulp]).reshape(1, -1)
    _assert_same(
        host_fp8.fp8_quantize(x, fmt, "tensor", 1.0),
        ops.fp8_quantize(x, fmt, "tensor", 1.0),
        str(fmt),
    )


@pytest.mark.parametrize("granularity", ops.GRANULARITIES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_gives_the_reference_values(granularity, out_dtype):
    for label, x in _inputs():
        for fmt in FORMATS:
            data, scale_inv, _ = ops.fp8_quantize(x, fmt, granularity)
            got = host_fp8.fp8_dequantize(data, scale_inv, granularity, out_dtype)
            want = ops.fp8_dequantize(data, scale_inv, granularity, out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want), f"{label} {fmt}"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_every_byte_dequantizes_exactly(out_dtype):
    """All 256 bytes of both formats (signed zeros, subnormals, infinities, NaN), as a
    transposed view too: a fallback GEMM's operands."""
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    for fmt in FORMATS:
        every = torch.arange(256, dtype=torch.uint8).view(fmt).reshape(16, 16).t()
        got = host_fp8.fp8_dequantize(every, torch.ones(()), "tensor", out_dtype)
        want = every.to(out_dtype)
        assert torch.equal(got.isnan(), want.isnan()), fmt
        finite = ~want.isnan()
        assert torch.equal(got[finite].view(bits), want[finite].view(bits)), fmt


def test_bad_arguments_fail_as_the_reference_does():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="2-D"):
        host_fp8.fp8_quantize(x[0], torch.float8_e4m3fn, "tensor")
    with pytest.raises(ValueError, match="granularity"):
        host_fp8.fp8_quantize_transpose(x, torch.float8_e4m3fn, "2x2")
    with pytest.raises(ValueError, match="only allowed"):
        host_fp8.fp8_quantize(x, torch.float8_e4m3fn, "row", 2.0)
    data = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must have shape"):
        host_fp8.fp8_dequantize(data, torch.ones(3, 1), "row")


def test_the_cpu_backend_serves_fp8_ops_from_the_c_kernels():
    table = select_backend("cpu").kernels
    for dtype, name in ((torch.bfloat16, "host-c"), (torch.float32, "host-c")):
        served = table.table(KernelQuery("cpu", dtype))
        for op in ("fp8_quantize", "fp8_quantize_transpose", "fp8_dequantize"):
            assert served[op][0].name == name, (op, dtype)
    # float16 inputs and results are the reference's (the guards send them there)
    x = torch.randn(8, 16, dtype=torch.float16)
    data, scale_inv, amax = table.fp8_quantize(x, torch.float8_e4m3fn, "row")
    _assert_same((data, scale_inv, amax), ops.fp8_quantize(x, torch.float8_e4m3fn, "row"), "fp16")
    half = table.fp8_dequantize(data, scale_inv, "row", torch.float16)
    assert torch.equal(half, ops.fp8_dequantize(data, scale_inv, "row", torch.float16))


def test_the_library_builds_once_into_the_cache_and_a_missing_compiler_falls_back(tmp_path):
    """In a fresh process and cache: the first load compiles, a second reuses the file;
    without a compiler (another fresh cache) the reference ops serve and doctor's line
    says why."""
    script = textwrap.dedent(
        """
        import json, os, torch
        from mtcore.backend import KernelQuery, host_fp8, native_build, select_backend
        from mtcore.backend.host import cpu_identity
        facts = {"first": host_fp8.describe(cpu_identity())}
        facts["files"] = sorted(str(p) for p in native_build.library_dir().glob("*"))
        stamps = [os.stat(p).st_mtime_ns for p in facts["files"]]
        host_fp8._loaded = None  # as a new process would
        facts["again"] = host_fp8.describe(cpu_identity())
        facts["rebuilt"] = stamps != [os.stat(p).st_mtime_ns for p in facts["files"]]
        os.environ.update(CC=os.environ["NO_COMPILER"], MTCORE_DATA_CACHE=os.environ["OTHER"])
        host_fp8._loaded = None
        table = select_backend("cpu").kernels.table(KernelQuery("cpu", torch.bfloat16))
        facts["served"] = table["fp8_quantize"][0].name
        facts["without"] = host_fp8.describe(cpu_identity())
        print(json.dumps(facts))
        """
    )
    env = {
        **os.environ,
        "MTCORE_DATA_CACHE": str(tmp_path / "cache"),
        "NO_COMPILER": str(tmp_path / "no-such-compiler"),
        "OTHER": str(tmp_path / "other"),
    }
    env.pop("CC", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    facts = json.loads(done.stdout.splitlines()[-1])
    library = tmp_path / "cache" / "host-kernels"
    assert [os.path.dirname(f) for f in facts["files"]] == [str(library)], facts
    assert os.path.basename(facts["files"][0]).startswith("host_fp8-"), facts
    assert "compiled for this CPU" in facts["first"] and facts["again"] == facts["first"]
    assert not facts["rebuilt"], facts
    assert facts["served"] == "reference", facts
    assert "no C compiler" in facts["without"] and "reference ops" in facts["without"], facts
