"""Collective contract on 2 and 4 ranks: one spawn per world size runs every check.

The spawn happens on the first test of a world size; its per-check outcomes are
cached for the session and each check is reported as its own test.
"""

from __future__ import annotations

import tempfile

import pytest

from mtcore.backend.checks.collective_checks import CHECK_NAMES, merge, run_all
from mtcore.testing.conformance.plugin import CAPABILITY
from mtcore.testing.distributed import RankFailure, run_ranks

WORLD_SIZES = (2, 4)
SPAWN_TIMEOUT_S = 240.0
_PARAMS = [(ws, name) for ws in WORLD_SIZES for name in CHECK_NAMES]


def _results(kit, backend, world_size: int):
    """Merged outcomes of every check on ``world_size`` ranks (spawned once, then cached)."""
    if world_size in kit.collective:
        return kit.collective[world_size]
    count = backend.device.device_count()
    if backend.device.type != "cpu" and count < world_size:
        result = f"{CAPABILITY} {world_size} ranks need {world_size} devices; {backend.name} sees {count}"
    else:
        with tempfile.TemporaryDirectory(prefix="mtcore-conformance-") as shared:
            try:
                per_rank = run_ranks(
                    run_all, world_size, shared, backend=backend.name, timeout_s=SPAWN_TIMEOUT_S
                )
                result = merge(per_rank)
            except RankFailure as exc:
                result = exc
        if isinstance(result, dict):
            paths = sorted(
                {
                    (n.split("-")[0], text)
                    for n, (o, text) in result.items()
                    if "float8" in n and o == "passed"
                }
            )
            if paths:
                kit.note("collective", "float8: " + ", ".join(f"{op} {text}" for op, text in paths))
    kit.collective[world_size] = result
    return result


@pytest.mark.parametrize(
    ("world_size", "check"), _PARAMS, ids=[f"{ws}ranks-{n}" for ws, n in _PARAMS]
)
def test_collective(world_size, check, kit, backend):
    result = _results(kit, backend, world_size)
    if isinstance(result, str):
        pytest.skip(result)
    if isinstance(result, Exception):
        pytest.fail(
            f"the {world_size}-rank spawn failed, so no check ran:\n{result}", pytrace=False
        )
    outcome, text = result[check]
    if outcome == "skipped":
        pytest.skip(text)
    if outcome == "failed":
        pytest.fail(f"{check} on {world_size} ranks:\n{text}", pytrace=False)
