"""The test tree itself: no two test modules share a file name.

pytest imports test modules without packages by their base name (rootdir-relative
"rootdir/conftest" mode), and the multi-rank helpers re-import a test module by name in
each rank: two ``test_x.py`` in different folders make one of them fail to collect
("import file mismatch") and the ranks of the other run the wrong file's functions.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name():
    where = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts and "build" not in path.parts:
            where[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared
