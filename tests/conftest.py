"""Shared fixtures: fake installed distributions for plugin-discovery tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def make_dist(tmp_path, monkeypatch):
    """Install a real (metadata + module) distribution into a directory on sys.path.

    Entry points are read from ``*.dist-info/entry_points.txt`` by importlib.metadata,
    exactly as for a pip-installed plugin.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def make(dist: str, module: str, source: str, entry: str | None = None, version: str = "1.0") -> Path:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[mtcore.plugins]\n{entry or module} = {module}\n")
        return root

    return make
