"""The docs' family lists and ``mtcore doctor``'s agree with the registry: the families
table of docs/models.md (its rows, and the capabilities it states), every paragraph
marked ``<!-- family-list -->`` in README.md and docs/, and the doctor's report."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtcore.models import BUILTIN_FAMILIES, get_family

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- family-list -->"


def _table(path: Path, header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(
            dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
        )
    return rows


def test_the_families_table_is_the_registry():
    rows = _table(ROOT / "docs" / "models.md", "| family | `model.family` |")
    by_name = {re.search(r"`(\w+)`", row["`model.family`"]).group(1): row for row in rows}
    assert set(by_name) == set(BUILTIN_FAMILIES)
    for name, row in by_name.items():
        caps = get_family(name).capabilities
        assert row["generates"].startswith("yes" if caps.generates else "no"), (name, row)
        assert row["cp"].startswith("yes" if caps.context_parallel else "no"), (name, row)
        assert (row["HF interop"] != "no") is (get_family(name).hf is not None), (name, row)


def _marked() -> list[tuple[str, str]]:
    """(where, paragraph) for each paragraph right after a family-list marker."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(re.escape(MARKER) + r"\n(.+?)(?:\n\n|\Z)", text, re.S):
            found.append(
                (
                    f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}",
                    match.group(1),
                )
            )
    return found


def test_marked_family_lists_name_every_family():
    marked = _marked()
    assert len(marked) >= 2, marked  # README's list and architecture.md's picture at least
    for where, paragraph in marked:
        missing = [n for n in BUILTIN_FAMILIES if not re.search(rf"\b{n}\b", paragraph, re.I)]
        assert not missing, f"{where} lists the model families without {missing}"


@pytest.mark.parametrize("name", sorted(BUILTIN_FAMILIES))
def test_the_architecture_picture_shows_each_family_folder(name):
    folder = BUILTIN_FAMILIES[name].rsplit(".", 2)[-2]  # mtcore.models.<folder>.family
    paragraphs = [p for where, p in _marked() if where.startswith("docs/architecture.md")]
    assert any(f"{folder}/" in p for p in paragraphs), f"docs/architecture.md lacks {folder}/"


def test_doctor_lists_the_registry():
    from mtcore.cli import report
    from mtcore.models import family_names

    facts = report.family_facts()
    assert facts["error"] is None
    assert [f["name"] for f in facts["families"]] == family_names()
    for entry in facts["families"]:
        caps = get_family(entry["name"]).capabilities
        assert entry["generates"] is caps.generates
        assert entry["capabilities"]["context_parallel"] is caps.context_parallel


# A choice list of `family` values in a doc, e.g. "`family` (gpt \| bert \| a plugin's)".
FAMILY_CHOICES = re.compile(r"`(?:model\.)?family` \(([^)]*\\\|[^)]*)\)")


def test_every_family_choice_list_in_the_docs_is_the_registry():
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in FAMILY_CHOICES.finditer(path.read_text()):
            choices = [c.strip(" `") for c in match.group(1).split(";")[0].split("\\|")]
            named = [c for c in choices if "plugin" not in c]
            found.append((path.relative_to(ROOT), named))
    assert found, "no `family` choice list in the docs (docs/training.md's config table has one)"
    for where, named in found:
        assert sorted(named) == sorted(BUILTIN_FAMILIES), f"{where} lists the families {named}"
