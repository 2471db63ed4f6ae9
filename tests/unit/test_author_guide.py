"""The plugin author guide's table of `Collective` methods (docs/plugin-author-guide.md,
"Collective methods") matches the class: every public method is listed with its
parameter names in order, and nothing is listed that the class does not have.

The table is written by hand, so that it can say what each method does; this test is
what keeps it from drifting when a signature changes.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from mtcore.backend import Collective

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-author-guide.md"
SECTION = "### Collective methods"
CALL = re.compile(r"`(\w+)\(([^`]*)\)`")


def methods_section(text: str) -> str:
    start = text.index(SECTION)
    end = text.find("\n#", start + len(SECTION))
    return text[start : end if end != -1 else len(text)]


def parameter_names(arguments: str) -> list[str]:
    """``'tensor, op="sum", *, x=1'`` -> ``['tensor', 'op', 'x']``."""
    names = []
    for part in arguments.split(","):
        name = re.split(r"[=:]", part.strip().lstrip("*"))[0].strip()
        if name:
            names.append(name)
    return names


def documented() -> dict[str, list[str]]:
    """``{method: parameter names}`` of every call the table's first column shows."""
    listed = {}
    for line in methods_section(GUIDE.read_text()).splitlines():
        if not line.startswith("| `"):
            continue
        first_column = line.split(" | ")[0]
        for name, arguments in CALL.findall(first_column):
            listed["__init__" if name == "Collective" else name] = parameter_names(arguments)
    return listed


def public_methods() -> dict[str, list[str]]:
    methods = {
        name: fn
        for name, fn in inspect.getmembers(Collective, inspect.isfunction)
        if not name.startswith("_") or name == "__init__"
    }
    return {
        name: [p for p in inspect.signature(fn).parameters if p != "self"]
        for name, fn in methods.items()
    }


def test_the_parser_reads_signatures():
    assert parameter_names('tensor, op="sum", group=None, async_op=False') == [
        "tensor",
        "op",
        "group",
        "async_op",
    ]
    assert parameter_names("") == []
    assert CALL.findall("`rank(group=None)`, `world_size(group=None)`") == [
        ("rank", "group=None"),
        ("world_size", "group=None"),
    ]


def test_every_public_method_of_collective_is_in_the_guide_with_its_parameters():
    listed, actual = documented(), public_methods()
    missing = sorted(set(actual) - set(listed))
    assert not missing, f"Collective methods missing from the guide's table: {missing}"
    wrong = {
        name: {"guide": listed[name], "code": params}
        for name, params in actual.items()
        if listed[name] != params
    }
    assert not wrong, f"parameter names in the guide differ from the code: {wrong}"


def test_the_guide_lists_no_method_collective_lacks():
    unknown = sorted(set(documented()) - set(public_methods()))
    assert not unknown, f"the guide's table lists methods Collective does not have: {unknown}"
