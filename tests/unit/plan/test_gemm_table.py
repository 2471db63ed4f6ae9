"""A hardware file's measured GEMM-shape table: exact where measured, interpolated in log
FLOPs between the nearest sizes, held at the ends; without one, the fitted constant and a
note saying so."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from mtcore.plan import HardwareError, load_hardware, plan, timing
from mtcore.plan.constants import GEMM_EFFICIENCY
from mtcore.plan.gemm import efficiency
from mtcore.training.overrides import load_config

TABLE = {"100x10x1": 0.2, "100x10x100": 0.6, "10x10x1000": 0.5}  # 2e3, 2e5, 2e5 FLOPs


def test_interpolation_by_hand():
    assert efficiency(TABLE, 2e5, (100, 10, 100)) == 0.6  # measured: its own
    assert efficiency(TABLE, 2e5) == pytest.approx(0.55)  # one size, two shapes: their mean
    # halfway between 2e3 and 2e5 in log FLOPs (2e4): halfway between 0.2 and 0.55
    assert efficiency(TABLE, 2e4) == pytest.approx(0.375)
    x = (math.log(6e3) - math.log(2e3)) / (math.log(2e5) - math.log(2e3))
    assert efficiency(TABLE, 6e3) == pytest.approx(0.2 + x * 0.35)
    assert efficiency(TABLE, 10.0) == 0.2 and efficiency(TABLE, 1e12) == pytest.approx(0.55)


def test_products_use_the_table_and_say_so():
    h100 = load_hardware("H100-SXM")
    products = timing.Products(h100, "bf16")
    peak = h100.peak_flops("bf16")
    assert products.seconds((4096, 2048, 6144)) == pytest.approx(
        2 * 4096 * 2048 * 6144 / timing.gemm_flops(h100, peak)
    )
    assert f"single constant {timing.gemm_flops(h100, 1.0):.3f} of peak" in products.note()
    table = {"4096x2048x6144": 0.5, "4096x2048x2048": 0.4}
    measured = timing.Products(replace(h100, gemm_efficiency={"bf16": table}), "bf16")
    assert measured.seconds((4096, 2048, 6144), calls=3) == pytest.approx(
        3 * 2 * 4096 * 2048 * 6144 / (0.5 * peak)
    )
    assert "measured GEMM-shape table (2 shapes" in measured.note()


def test_a_plan_with_a_table_credits_its_fractions():
    """A table giving every product half of peak: the products take GEMM_EFFICIENCY / 0.5
    times as long as at the fitted constant (A100, where the constant is unscaled)."""
    a100 = load_hardware("A100-80GB")
    config = load_config("configs/default.yaml", ["--precision.dtype", "bf16"])
    plain = plan(config, 4, a100)
    half = plan(config, 4, replace(a100, gemm_efficiency={"bf16": {"1x1x1": 0.5}}))
    assert half.time.compute == pytest.approx(plain.time.compute * GEMM_EFFICIENCY / 0.5)
    assert any("single constant" in n for n in plain.notes)
    assert any("GEMM-shape table (1 shapes" in n for n in half.notes)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('"4096x2048" = 0.5', "MxKxN"),
        ('"4096x2048x6144" = 1.5', "fraction of peak in"),
        ('"4096x2048x6144" = nan', "fraction of peak in"),
        ('"0x2048x6144" = 0.5', "MxKxN"),
    ],
)
def test_a_bad_table_is_refused(tmp_path, table, message):
    text = Path(load_hardware("H100-SXM").path).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("\n[sources]", f"\n[gemm_efficiency.bf16]\n{table}\n\n[sources]"))
    with pytest.raises(HardwareError, match=message):
        load_hardware(str(bad))
    nodtype = tmp_path / "nodtype.toml"
    nodtype.write_text(
        text.replace("\n[sources]", '\n[gemm_efficiency.int4]\n"1x1x1" = 0.5\n[sources]')
    )
    with pytest.raises(HardwareError, match="gives no int4 peak"):
        load_hardware(str(nodtype))
