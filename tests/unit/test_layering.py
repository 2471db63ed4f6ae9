"""The core stays hardware-neutral and its imports point down the layers
(docs/architecture.md); training/, cli/ and plan/ know models only through the family
seam, and no family imports another (what they share is models/common). The family
names, folders and exports the checks look for come from the registry."""

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
    "precision": {"backend", "ops"},
    "parallel": {"backend", "ops", "precision"},
    "models": {"backend", "ops", "data", "precision", "parallel"},
    "training": {"backend", "ops", "data", "precision", "parallel", "models"},
    "plan": {
        "backend",
        "ops",
        "data",
        "precision",
        "parallel",
        "models",
        "training",
    },
}
# What training/, cli/ and plan/ may import from mtcore.models: the seam, never a family
# nor the families' shared internals (models/common).
SEAM = {"mtcore.models", "mtcore.models.family", "mtcore.models.registry", "mtcore.models.shape"}


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


def _family_packages() -> dict[str, str]:
    """Family name -> the package of its folder (``mtcore.models.gpt``), from the registry."""
    from mtcore.models import BUILTIN_FAMILIES

    return {name: module.rsplit(".", 1)[0] for name, module in BUILTIN_FAMILIES.items()}


def _concrete_names() -> set[str]:
    """What a family folder exports (its model, config and family classes...), from the
    registry: the names the seam must not hand to training/, cli/ or plan/."""
    import importlib

    from mtcore.models import family_names, get_family

    names = set()
    for package in _family_packages().values():
        names |= set(importlib.import_module(package).__all__)
    for name in family_names():
        family = get_family(name)
        names |= {type(family).__name__, family.config.__name__}
    return names - {"FAMILY"}


def test_training_cli_and_plan_import_no_concrete_model():
    import mtcore.models

    seam_names = set(mtcore.models.__all__)
    packages = set(_family_packages().values())
    assert {"mtcore.models.gpt", "mtcore.models.bert"} <= packages  # the registry was read
    wrong = []
    for package in ("training", "cli", "plan"):
        for path in sorted((SRC / package).rglob("*.py")):
            for module, names in _imports(path):
                where = f"{path.relative_to(SRC)} imports {module}"
                if module.startswith("mtcore.models") and module not in SEAM:
                    wrong.append(where)
                elif module == "mtcore.models" and set(names) - seam_names:
                    wrong.append(f"{where}: {sorted(set(names) - seam_names)}")
    assert not wrong, "training/, cli/ and plan/ must use the seam only:\n" + "\n".join(wrong)


def test_the_seam_exports_no_concrete_model():
    import mtcore.models

    concrete = sorted(set(mtcore.models.__all__) & _concrete_names())
    assert {"GPT", "GPTConfig", "BertConfig", "GPTFamily"} <= _concrete_names()
    assert not concrete, f"mtcore.models re-exports concrete models: {concrete}"


def test_no_family_imports_another_family():
    """Families compose models/common; a family's folder imports no other family's."""
    packages = _family_packages()
    wrong = []
    for name, package in packages.items():
        others = {p for n, p in packages.items() if n != name}
        folder = SRC.parent / package.replace(".", "/")
        for path in sorted(folder.rglob("*.py")):
            for module, _ in _imports(path):
                if any(module == p or module.startswith(p + ".") for p in others):
                    wrong.append(f"{path.relative_to(SRC)} imports {module}")
    assert not wrong, "a family imports another family:\n" + "\n".join(wrong)
