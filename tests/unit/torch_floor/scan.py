"""Find every use of a torch API in mtcore's source, statically.

A use is a dotted name that starts at ``torch`` (``torch.distributed.checkpoint.save``),
reached through the file's own imports (``import torch.nn.functional as F`` makes
``F.rms_norm`` ``torch.nn.functional.rms_norm``; ``from torch.x import y`` makes ``y``
``torch.x.y``), with the keyword arguments of a call to it. What the scan cannot see:
names reached through ``getattr`` with a string, methods of tensors, keywords passed as
``**kwargs``. The oldest-torch CI job runs the suite itself for those.

Used by ``test_torch_floor.py`` and by ``record_api.py`` (run in the oldest supported torch).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Every distribution's package sources: the core and the plugins.
SOURCES = (ROOT / "src", *sorted((ROOT / "plugins").glob("*/src")))


@dataclass(frozen=True)
class Use:
    path: str  # relative to the repository root
    line: int
    name: str  # torch.x.y
    keywords: tuple[str, ...] = ()


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch dotted name it stands for, from the module's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def uses_in(path: Path) -> list[Use]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = _aliases(tree)
    if not aliases:
        return []
    where = str(path.relative_to(ROOT))
    found: dict[tuple[int, str], set[str]] = {}
    # An import is a use of what it imports.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "torch":
                for alias in node.names:
                    if alias.name != "*":
                        found.setdefault((node.lineno, f"{node.module}.{alias.name}"), set())
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    found.setdefault((node.lineno, alias.name), set())
    inner: set[int] = set()  # attribute nodes inside a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            if name is not None:
                keywords = {k.arg for k in node.keywords if k.arg is not None}
                found.setdefault((node.lineno, name), set()).update(keywords)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node, aliases)
            if name is not None:
                found.setdefault((node.lineno, name), set())
    return [
        Use(where, line, name, tuple(sorted(keywords)))
        for (line, name), keywords in sorted(found.items())
    ]


def all_uses() -> list[Use]:
    uses = []
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            uses += uses_in(path)
    return uses
