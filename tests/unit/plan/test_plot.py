"""The picture of step time and memory per layout (``mtcore.plan.plot``): a PNG of the
stated size that Pillow opens, an SVG whose text names every layout, written by
``mtcore plan --compare`` (planned alone) and skipped in one line without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from mtcore.cli.main import main
from mtcore.plan.plot import MISSING, LayoutBars, size_px, write_picture

pytest.importorskip("matplotlib")  # the test extra installs it; mtcore[plot] for users

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "default.yaml")  # from any cwd
COMPARE = ["plan", CONFIG, "--gpus", "4", "--hardware", "cpu-host", "--compare"]


def test_measured_beside_planned_png_and_svg(tmp_path):
    bars = [
        LayoutBars("tp=2,pp=2", 0.40, 210e6, measured_s=0.50, measured_bytes=230e6),
        LayoutBars("tp=1,pp=2", 0.30, 300e6, note="failed"),
    ]
    png, svg = write_picture(tmp_path / "sweep" / "layouts.png", bars, "two layouts")
    assert png == tmp_path / "sweep" / "layouts.png" and svg.suffix == ".svg"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == size_px(2) == (1000, 450)
        assert len(image.convert("RGB").getcolors(1 << 20)) > 10  # bars drawn, not a blank page
    text = svg.read_text()
    for word in ("tp=2,pp=2", "tp=1,pp=2", "measured", "planned", "failed", "x1.25", "x1.10"):
        assert f">{word}<" in text, word  # text kept as text, not as glyph paths
    assert size_px(12)[0] > 1000  # wider past eight layouts


def test_plan_compare_writes_the_picture_of_its_layouts(tmp_path, capsys):
    out = tmp_path / "compare.png"
    layouts = ["tp=1,pp=4", "tp=1,pp=4,schedule=zb_h1", "tp=4"]  # tp=4 x pp=2: rejected
    assert main([*COMPARE, *layouts, "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1] == f"picture: {out}, {out.with_suffix('.svg')}"
    with Image.open(out) as image:
        assert image.size == (1000, 450)
    text = out.with_suffix(".svg").read_text()
    assert all(f">{name}<" in text for name in layouts) and ">rejected<" in text
    assert ">measured<" not in text  # a plan has no measurement


def test_json_keeps_stdout_one_document_and_none_skips(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*COMPARE, "tp=1,pp=4", "tp=2,pp=2", "--json"]) == 0
    out = capsys.readouterr()
    assert set(json.loads(out.out)) == {"tp=1,pp=4", "tp=2,pp=2"}
    assert out.err.strip().startswith("picture: runs/plan/compare.png")  # the default place
    assert (tmp_path / "runs" / "plan" / "compare.svg").is_file()
    assert main([*COMPARE, "tp=1,pp=4", "--plot", "none"]) == 0
    assert "picture" not in capsys.readouterr().out


def test_without_matplotlib_one_line_and_the_command_succeeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    out = tmp_path / "compare.png"
    assert main([*COMPARE, "tp=1,pp=4", "--plot", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == MISSING and sum("matplotlib" in line for line in lines) == 1
    assert not out.exists() and not out.with_suffix(".svg").exists()
    assert write_picture(out, [LayoutBars("tp=1", 1.0, 1.0)], "t") is None
