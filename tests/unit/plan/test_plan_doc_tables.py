"""docs/plan.md's two tables of published runs show what the planner predicts today.

Each row's "predicted" and "error" cells are recomputed (``fit.every_row``, the rows
``fit.py`` prints) and compared at the precision the cell is printed with, so a planner
change that moves a prediction fails here until the table is updated. The "before"
column is the previous release's figure, a record that no test regenerates.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from fit import every_row

PLAN_DOC = Path(__file__).resolve().parents[3] / "docs" / "plan.md"
PUBLISHED_SOURCES = ("Narayanan 2021 ", "Megatron-Core 2024 ")
PAREN = re.compile(r" \(.*\)")  # "Narayanan 2021 (A100)" -> "Narayanan 2021"
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


def table_rows(header_start: str) -> list[list[str]]:
    """The body rows (cells stripped) of the table in docs/plan.md whose header row
    starts with ``header_start``."""
    lines = PLAN_DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@cache
def predictions() -> dict[str, tuple[float, float]]:
    return {label: (predicted, published) for label, predicted, published, _ in every_row()}


def check_cells(label: str, predicted_cell: str, error_cell: str) -> None:
    """The first number of ``predicted_cell`` and the percentage of ``error_cell`` are
    the planner's, rounded as printed."""
    predicted, published = predictions()[label]
    shown = NUMBER.search(predicted_cell).group()
    decimals = len(shown.partition(".")[2])
    assert abs(float(shown) - predicted) <= 0.5 * 10**-decimals + 1e-9, (
        f"{label}: docs/plan.md says {shown}, the planner predicts {predicted:.{decimals}f}"
    )
    error = 100 * (predicted / published - 1)
    assert error_cell == f"{error:+.1f}%", (
        f"{label}: docs/plan.md says error {error_cell}, the planner gives {error:+.1f}%"
    )


def test_published_table_matches_the_planner():
    rows = table_rows("| source | model | tp x pp |")
    labels = [f"{PAREN.sub('', source)} {model}" for source, model, *_ in rows]
    published = [label for label in predictions() if label.startswith(PUBLISHED_SOURCES)]
    assert labels == published, "one docs/plan.md row per published row, in fit.py's order"
    for (_, _, _, _, _, predicted, error, *_), label in zip(rows, labels, strict=True):
        check_cells(label, predicted, error)


def test_held_out_table_matches_the_planner():
    rows = table_rows("| run (source) | layout as planned |")
    held_out = [label for label in predictions() if not label.startswith(PUBLISHED_SOURCES)]
    assert len(rows) == len(held_out), "one docs/plan.md row per held-out run"
    for run, _, _, predicted, error, _ in rows:
        label = next((name for name in held_out if run.startswith(name)), None)
        assert label is not None, f"docs/plan.md row {run!r} names no held-out run"
        check_cells(label, predicted, error)
