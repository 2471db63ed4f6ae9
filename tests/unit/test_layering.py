"""The core stays hardware-neutral and its imports point down the layers
(docs/architecture.md), and training/ and cli/ know models only through the family seam."""

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
    "data": set(),  # tokenizer, indexed documents, samplers: torch, numpy, tokenizers
    "distributed": {"backend", "ops"},
    "precision": {"backend", "ops"},
    "parallel": {"backend", "ops", "distributed", "precision"},
    "models": {"backend", "ops", "data", "distributed", "precision", "parallel"},
}
# What training/ and cli/ may import from mtcore.models: the seam, never a family.
SEAM = {"mtcore.models", "mtcore.models.family", "mtcore.models.registry"}


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


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every absolute import in ``path`` (names: what a
    ``from`` import takes; ``[]`` for ``import x``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def test_training_and_cli_import_no_concrete_model():
    import mtcore.models

    seam_names = set(mtcore.models.__all__)
    wrong = []
    for package in ("training", "cli", "plan"):
        for path in sorted((SRC / package).rglob("*.py")):
            for module, names in _imports(path):
                where = f"{path.relative_to(SRC)} imports {module}"
                if module.startswith("mtcore.models") and module not in SEAM:
                    wrong.append(where)
                elif module == "mtcore.models" and set(names) - seam_names:
                    wrong.append(f"{where}: {sorted(set(names) - seam_names)}")
    assert not wrong, "training/ and cli/ must use the family seam only:\n" + "\n".join(wrong)


def test_the_seam_exports_no_concrete_model():
    import mtcore.models

    concrete = [n for n in mtcore.models.__all__ if n in {"GPT", "GPTConfig", "Bert", "BertConfig"}]
    assert not concrete, f"mtcore.models re-exports concrete models: {concrete}"
