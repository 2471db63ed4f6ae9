"""No torch API newer than the oldest supported torch without a guarded fallback.

``scan.py`` finds every torch name mtcore's source uses (and the keywords of each
call); ``torch_api_floor.json`` is that surface as the oldest supported torch has it,
recorded there by ``record_api.py`` (``make torch-floor-record``). A use missing from
the record, or a keyword the recorded signature lacks, fails here unless ``GUARDED``
names it with the guard that keeps older torches working. The oldest-torch CI job
(docs/ci.md) runs the suite itself on that torch for what no scan can see.
"""

from __future__ import annotations

import json
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version
from scan import ROOT, Use, all_uses

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

RECORD = json.loads(Path(__file__).with_name("torch_api_floor.json").read_text())
DISTRIBUTIONS = tuple(
    str(path.relative_to(ROOT))
    for pattern in ("pyproject.toml", "plugins/*/pyproject.toml", "docs/examples/*/pyproject.toml")
    for path in sorted(ROOT.glob(pattern))
)

# name, or name(keyword) -> how the code keeps working where the floor lacks it.
GUARDED = {
    # torch_musa's patched torch and torch_musa itself: vendor names, probed before use.
    "torch.nn.functional.rope": "mtcore_musa.kernels: registered only if hasattr(F, 'rope')",
    "torch.nn.functional.swish_glu": "mtcore_musa.kernels: only if hasattr(F, 'swish_glu')",
    "torch.backends.mudnn.version": "mtcore_musa.kernels.mudnn_version: any error means None",
    "torch.ops.musa._fused_adamw_": "registered only when musa_fused_adamw_available()",
    "torch.ops.aten._scaled_dot_product_attention_flash_musa": (
        "torch_musa's patched torch: attention_lse registered only if has_musa_kernel(op)"
    ),
    "torch.ops.aten._scaled_dot_product_attention_flash_musa_backward": (
        "called only by the adapter registered under the same probe"
    ),
}


def _requirement(pyproject: str, package: str) -> Requirement:
    project = tomllib.loads((ROOT / pyproject).read_text())["project"]
    (req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == package]
    return req


def _floor() -> Version:
    return Version(Version(RECORD["torch"]).base_version)


def _problem(use: Use) -> str | None:
    parts = use.name.split(".")
    modules, signatures = RECORD["modules"], RECORD["signatures"]
    for end in range(1, len(parts)):
        parent = ".".join(parts[:end])
        if parent not in modules:
            break  # a value (torch.__version__, a function): nothing more to look up
        child = ".".join(parts[: end + 1])
        if parts[end] not in modules[parent] and child not in modules:
            return f"{child} is not in torch {RECORD['torch']}"
    known = signatures.get(use.name)
    if known is not None:
        missing = [k for k in use.keywords if k not in known]
        if missing:
            return f"{use.name}({', '.join(missing)}=...) is not in torch {RECORD['torch']}"
    return None


def test_record_is_of_the_oldest_supported_torch():
    for pyproject in DISTRIBUTIONS:
        req = _requirement(pyproject, "torch")
        lowest = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert lowest == [_floor()], f"{pyproject}: {req} (recorded: torch {RECORD['torch']})"


def test_every_distribution_declares_one_torch_range_and_ci_pins_inside_it():
    ranges = {str(_requirement(p, "torch").specifier) for p in DISTRIBUTIONS}
    assert len(ranges) == 1, ranges
    pins = [
        line.split("==")[1].strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("torch==")
    ]
    specifier = _requirement("pyproject.toml", "torch").specifier
    assert pins and all(specifier.contains(pin) for pin in pins), (pins, specifier)


def test_no_torch_api_newer_than_the_floor_without_a_guard():
    problems = []
    for use in all_uses():
        problem = _problem(use)
        guarded = use.name in GUARDED or any(f"{use.name}({k})" in GUARDED for k in use.keywords)
        if problem and not guarded:
            problems.append(f"{use.path}:{use.line}: {problem}")
    assert not problems, (
        "torch APIs the oldest supported torch lacks (guard them and list the guard in "
        "GUARDED, or record a new use with `make torch-floor-record`):\n" + "\n".join(problems)
    )


def test_guards_listed_are_still_needed():
    needed = set()
    for use in all_uses():
        if _problem(use):
            needed.add(use.name)
            needed.update(f"{use.name}({k})" for k in use.keywords)
    assert not set(GUARDED) - needed, sorted(set(GUARDED) - needed)


def test_the_scan_sees_what_it_must(tmp_path):
    """A keyword that torch 2.7.1's async_save lacks, through an alias, is caught."""
    source = ROOT / "src" / "_torch_floor_probe.py"
    source.write_text(
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.staging import AsyncStager\n"
        "dcp.async_save({}, async_stager=AsyncStager(), checkpoint_id='x')\n"
        "from torch.nn import functional as F\nF.no_such_function_anywhere\n"
    )
    try:
        from scan import uses_in

        uses = {u.name: u for u in uses_in(source)}
    finally:
        source.unlink()
    assert uses["torch.distributed.checkpoint.async_save"].keywords == (
        "async_stager",
        "checkpoint_id",
    )
    assert "async_stager" in _problem(uses["torch.distributed.checkpoint.async_save"])
    assert "no_such_function_anywhere" in _problem(
        uses["torch.nn.functional.no_such_function_anywhere"]
    )
    assert _problem(uses["torch.distributed.checkpoint.staging.AsyncStager"]) is None
