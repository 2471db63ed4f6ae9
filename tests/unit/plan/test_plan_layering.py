"""``mtcore.plan`` ships its hardware descriptions beside the code. (That plan/ is layer 5
and reads families only through the seam is tests/unit/test_layering.py's check, with
training/ and cli/.)"""

from __future__ import annotations

from pathlib import Path

PLAN = Path(__file__).resolve().parents[3] / "src" / "mtcore" / "plan"


def test_the_hardware_files_ship_beside_the_code():
    assert sorted(p.stem for p in (PLAN / "hardware").glob("*.toml")) == [
        "a100-80gb",
        "b200",
        "cpu-host",
        "h100-sxm",
        "h200",
        "mtt-s4000",
    ]
