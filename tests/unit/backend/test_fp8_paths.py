"""Which FP8 GEMM path a backend takes where torch runs both: measured, cached, said.

Real measurements of torch._scaled_mm and the fallback matmul on this host, a
real cache file in a temporary data cache, and the FP8 interface that consumes the
choice. Which path wins is the host's business; what is checked is that the choice
follows the measurement, is remembered, can be overridden, and is explained.
"""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.backend import FP8, fp8_paths
from mtcore.backend.fp8 import FALLBACK, GemmPath, fallback_scaled_matmul
from mtcore.backend.host import NATIVE_FP8, cpu_identity, cpu_scaled_mm_pairs
from mtcore.ops import fp8_dequantize

E4M3 = torch.float8_e4m3fn
# Measuring times torch._scaled_mm itself, which torch 2.7 does not run on the CPU.
needs_cpu_scaled_mm = pytest.mark.skipif(
    cpu_scaled_mm_pairs() != NATIVE_FP8,
    reason=f"torch {torch.__version__} has no CPU torch._scaled_mm for {sorted(NATIVE_FP8)}",
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTCORE_DATA_CACHE", str(tmp_path))
    monkeypatch.delenv(fp8_paths.GEMM_ENV, raising=False)
    return tmp_path


def _agrees_with_its_measurement(path: GemmPath) -> bool:
    return path.native == ("not slower" in path.reason)


@needs_cpu_scaled_mm
def test_the_cpu_pairs_are_measured_once_then_read_from_the_cache(cache, monkeypatch):
    first = fp8_paths.measured_paths(NATIVE_FP8, machine=cpu_identity())
    assert set(first) == set(NATIVE_FP8)
    for path in first.values():
        assert path.reason.startswith("torch._scaled_mm ") and _agrees_with_its_measurement(path)
        assert "for torch " + torch.__version__ in path.source
    (file,) = cache.glob("fp8-gemm-paths-*.json")
    record = json.loads(file.read_text())
    assert record["torch"] == torch.__version__ and record["machine"] == cpu_identity()
    assert set(record["pairs"]) == {"row x row", "tensor x tensor"}
    assert str(file) in first[("tensor", "tensor")].source

    def no_second_measurement(pair):
        raise AssertionError(f"{pair} measured again")

    monkeypatch.setattr(fp8_paths, "_measure", no_second_measurement)
    assert fp8_paths.measured_paths(NATIVE_FP8, machine=cpu_identity()) == first
    with pytest.raises(AssertionError, match="measured again"):  # another machine: its own file
        fp8_paths.measured_paths(NATIVE_FP8, machine="another cpu")


@needs_cpu_scaled_mm
def test_an_unreadable_cache_is_measured_again_and_rewritten(cache):
    paths = fp8_paths.measured_paths({("tensor", "tensor")}, machine="m")
    (file,) = cache.glob("fp8-gemm-paths-*.json")
    file.write_text("{not json")
    again = fp8_paths.measured_paths({("tensor", "tensor")}, machine="m")
    assert set(again) == set(paths) and _agrees_with_its_measurement(again[("tensor", "tensor")])
    assert "tensor x tensor" in json.loads(file.read_text())["pairs"]


@needs_cpu_scaled_mm
def test_an_unwritable_cache_still_measures_and_says_so(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MTCORE_DATA_CACHE", str(blocker / "cache"))  # under a file
    monkeypatch.delenv(fp8_paths.GEMM_ENV, raising=False)
    (path,) = fp8_paths.measured_paths({("tensor", "tensor")}, machine="m").values()
    assert _agrees_with_its_measurement(path) and "not cached" in path.source


def test_the_environment_overrides_the_measurement(cache, monkeypatch):
    monkeypatch.setenv(fp8_paths.GEMM_ENV, "native")
    paths = fp8_paths.measured_paths(NATIVE_FP8, machine="m")
    assert all(p.native and p.reason == "MTCORE_FP8_GEMM=native" for p in paths.values())
    monkeypatch.setenv(fp8_paths.GEMM_ENV, "fallback")
    assert not any(p.native for p in fp8_paths.measured_paths(NATIVE_FP8, machine="m").values())
    assert not list(cache.glob("fp8-gemm-paths-*"))  # nothing measured
    monkeypatch.setenv(fp8_paths.GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match="MTCORE_FP8_GEMM='fastest'"):
        fp8_paths.measured_paths(NATIVE_FP8, machine="m")


def test_a_pair_chosen_slower_takes_the_fallback_and_says_why():
    slow = GemmPath(False, "torch._scaled_mm 9x slower than the fallback matmul at 32x32x32")
    choose = lambda declared: {  # noqa: E731
        pair: slow if pair == ("tensor", "tensor") else GemmPath(True, "fast") for pair in declared
    }
    fp8 = FP8(native_granularities=NATIVE_FP8, choose=choose)
    assert fp8.native_granularities == {("row", "row")}
    assert fp8.describe()["tensor"] == FALLBACK and fp8.describe()["row"] == "native"
    assert fp8.why()["tensor"] == slow.reason and fp8.why()["row"] == "fast"
    g = torch.Generator().manual_seed(0)
    a = fp8.quantize(torch.randn(32, 64, generator=g), E4M3)
    b = fp8.quantize(torch.randn(48, 64, generator=g), E4M3)
    assert torch.equal(fp8.scaled_matmul(a, b), fallback_scaled_matmul(a, b, torch.float32))


@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16])
def test_fp8_bytes_widen_exactly(wide):
    """The fallback GEMM's operands: FP8 bytes dequantized with a unit scale are exact."""
    every_byte = torch.arange(256, dtype=torch.uint8)
    bits = torch.int32 if wide == torch.float32 else torch.int16
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = every_byte.view(dtype).reshape(16, 16).t()  # not contiguous either
        want, got = values.to(wide), fp8_dequantize(values, torch.ones(()), "tensor", wide)
        assert got.dtype == wide and torch.equal(want.isnan(), got.isnan()), dtype
        finite = ~want.isnan()
        # bit patterns: -0.0 stays -0.0
        assert torch.equal(want[finite].view(bits), got[finite].view(bits)), dtype


def test_the_measurements_live_in_the_data_cache(monkeypatch, tmp_path):
    from mtcore.backend.cache import default_cache_dir
    from mtcore.data import default_cache_dir as data_cache_dir

    monkeypatch.delenv("MTCORE_DATA_CACHE", raising=False)
    assert default_cache_dir() == data_cache_dir()
    monkeypatch.setenv("MTCORE_DATA_CACHE", str(tmp_path))
    assert default_cache_dir() == data_cache_dir() == tmp_path
