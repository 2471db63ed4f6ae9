"""The core stays hardware-neutral and its imports point down the layers (design.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mtcore"

VENDOR = re.compile(
    r"torch\.cuda|\.cuda\(|torch\.musa|torch_musa|[\"'](cuda|nccl|musa|mccl|triton)[\"']"
    r"|^\s*(import|from)\s+triton",
    re.MULTILINE,
)

# package -> the mtcore packages it may import (besides itself)
LAYERS = {
    "backend": {"ops"},
    "ops": set(),  # the spec depends on torch alone
    "distributed": {"backend", "ops"},
    "precision": {"backend", "ops"},
    "parallel": {"backend", "ops", "distributed", "precision"},
    "models": {"backend", "ops", "distributed", "precision", "parallel"},
}


def test_no_vendor_names_in_the_core():
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        for match in VENDOR.finditer(path.read_text()):
            line = path.read_text()[: match.start()].count("\n") + 1
            hits.append(f"{path.relative_to(SRC)}:{line}: {match.group(0).strip()}")
    assert not hits, "vendor names in src/mtcore:\n" + "\n".join(hits)


def test_imports_point_down_the_layers():
    wrong = []
    for package, allowed in LAYERS.items():
        for path in sorted((SRC / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    inner = parts[0] == "mtcore" and len(parts) > 1 and parts[1] != package
                    if inner and parts[1] not in allowed:
                        wrong.append(f"{path.relative_to(SRC)} imports {name}")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(wrong)
