"""``mtcore.plan`` is layer 5 (beside training and cli) and reads families only through
the seam, as tests/unit/test_layering.py requires of training/ and cli/."""

from __future__ import annotations

import ast
from pathlib import Path

PLAN = Path(__file__).resolve().parents[3] / "src" / "mtcore" / "plan"
SEAM = {"mtcore.models", "mtcore.models.family", "mtcore.models.registry"}


def test_plan_imports_no_concrete_model():
    wrong = []
    for path in sorted(PLAN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            wrong += [
                f"{path.name} imports {n}"
                for n in names
                if n.startswith("mtcore.models") and n not in SEAM
            ]
    assert not wrong, wrong


def test_the_hardware_files_ship_beside_the_code():
    assert sorted(p.stem for p in (PLAN / "hardware").glob("*.toml")) == [
        "a100-80gb",
        "b200",
        "cpu-host",
        "h100-sxm",
        "h200",
        "mtt-s4000",
    ]
