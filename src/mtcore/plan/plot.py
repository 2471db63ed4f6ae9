"""Step time and peak memory per layout, measured beside planned, as a picture: what
``mtcore sweep`` and ``mtcore plan --compare`` write (a PNG and an SVG of the same
stem). matplotlib is an optional extra (``pip install 'mtcore[plot]'``): without it
``write_picture`` returns None and the commands say so in one line.

The SVG keeps its text as text (``svg.fonttype: none``), so a layout's name can be
searched for in it; the PNG is ``size_px(len(layouts))`` pixels, whatever the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MISSING = "picture skipped: matplotlib is not installed (pip install 'mtcore[plot]')"
DPI = 100
HEIGHT_IN = 4.5
MEASURED_COLOR, PLANNED_COLOR = "#1f77b4", "#ff7f0e"


@dataclass
class LayoutBars:
    """One layout's bars: seconds per step and peak bytes per rank, planned and (from a
    sweep) measured; ``note`` is shown where a bar is missing (failed, rejected)."""

    layout: str
    planned_s: float | None
    planned_bytes: float | None
    measured_s: float | None = None
    measured_bytes: float | None = None
    note: str = ""


def size_px(count: int) -> tuple[int, int]:
    """The PNG's (width, height) for ``count`` layouts: 1000 x 450, wider past eight."""
    return round(_width_in(count) * DPI), round(HEIGHT_IN * DPI)


def _width_in(count: int) -> float:
    return max(10.0, 2.0 + 1.0 * count)


def write_picture(png: str | Path, layouts: list[LayoutBars], title: str) -> list[Path] | None:
    """Draw ``layouts`` to ``png`` and the same stem's .svg (folders made); the two paths,
    or None without matplotlib."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    png = Path(png)
    svg = png.with_suffix(".svg")
    png.parent.mkdir(parents=True, exist_ok=True)
    measured = any(bars.measured_s is not None for bars in layouts)
    style = {"svg.fonttype": "none", "svg.hashsalt": "mtcore", "font.size": 9}
    with matplotlib.rc_context(style):
        figure = Figure(figsize=(_width_in(len(layouts)), HEIGHT_IN), dpi=DPI, layout="constrained")
        time_axes, memory_axes = figure.subplots(1, 2)
        _panel(time_axes, layouts, "s", 1.0, "step time (s)", measured)
        _panel(memory_axes, layouts, "bytes", 1e6, "peak memory per rank (MB)", measured)
        figure.suptitle(title)
        keys = [("measured", MEASURED_COLOR)] if measured else []
        keys.append(("planned", PLANNED_COLOR))
        handles = [Patch(color=color, label=name) for name, color in keys]
        figure.legend(handles=handles, loc="outside lower center", ncols=2, frameon=False)
        figure.savefig(png, dpi=DPI, metadata={"Software": None})
        figure.savefig(svg, metadata={"Date": None})
    return [png, svg]


def _panel(axes, layouts: list[LayoutBars], unit: str, scale: float, label: str, measured: bool):
    """Bars of one quantity per layout: measured and planned side by side (planned
    alone without a sweep), the measured/planned ratio above each measured bar."""
    width = 0.38 if measured else 0.6
    top = 0.0
    for x, bars in enumerate(layouts):
        planned = getattr(bars, f"planned_{unit}")
        found = getattr(bars, f"measured_{unit}")
        spots = [(x - width / 2, found, MEASURED_COLOR), (x + width / 2, planned, PLANNED_COLOR)]
        for spot, value, color in spots if measured else [(x, planned, PLANNED_COLOR)]:
            if value is not None:
                axes.bar(spot, value / scale, width, color=color)
                top = max(top, value / scale)
        if measured and found is not None and planned:
            axes.annotate(f"x{found / planned:.2f}", (x - width / 2, found / scale),
                          ha="center", va="bottom", fontsize=8)  # fmt: skip
        if bars.note and (planned is None or (measured and found is None)):
            spot = x - width / 2 if measured and planned is not None else x
            axes.annotate(bars.note, (spot, 0), ha="center", va="bottom", color="gray")
    axes.set_xticks(range(len(layouts)), [bars.layout for bars in layouts])
    if (
        len(layouts) > 3 or max(len(bars.layout) for bars in layouts) > 16
    ):  # slanted, not overlapping
        for tick in axes.get_xticklabels():
            tick.set(rotation=20, ha="right", rotation_mode="anchor")
    axes.set_xlim(-0.6, len(layouts) - 0.4)
    axes.set_ylim(0, (top or 1.0) * 1.12)
    axes.set_ylabel(label)
