"""The self-check's cache cannot go stale: its key covers the kernels' code, and an entry
edited by hand is not trusted (issue 48: a plugin installed with ``pip install -e`` and
edited to be 1% wrong trained on the old "passed")."""

from __future__ import annotations

import json

import torch

from mtcore.backend import select_backend
from mtcore.backend.checks.selfcheck import cached_check, code_digest, key_of, last_results


def test_the_code_digest_follows_every_code_file_of_the_package(tmp_path, monkeypatch):
    package = tmp_path / "edited_plugin"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    kernel = package / "ops" / "norm.py"
    kernel.write_text("def rms_norm(x, weight, eps=1e-6):\n    return x * weight\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_digest("edited_plugin.ops.norm")
    code_digest.cache_clear()
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "norm.cpython-311.pyc").write_bytes(b"compiled")
    (package / "README.md").write_text("not code")
    assert code_digest("edited_plugin.ops.norm") == first  # caches and prose change nothing
    code_digest.cache_clear()
    kernel.write_text("def rms_norm(x, weight, eps=1e-6):\n    return x * weight * 1.01\n")
    edited = code_digest("edited_plugin.ops.norm")
    assert edited != first  # the 1% edit is another key
    code_digest.cache_clear()
    (package / "helpers.py").write_text("SCALE = 1.0\n")  # any module of the package counts
    assert code_digest("edited_plugin") not in (first, edited)
    code_digest.cache_clear()
    assert code_digest("no_such_package_here") == "?"


def test_the_key_names_the_code_of_each_selected_kernel(monkeypatch):
    backend = select_backend("cpu")
    before = key_of(backend, torch.float32)
    import mtcore.backend.checks.selfcheck as selfcheck

    monkeypatch.setattr(selfcheck, "code_digest", lambda module: "edited")
    assert key_of(backend, torch.float32) != before


def test_an_entry_edited_by_hand_is_not_trusted(tmp_path):
    backend = select_backend("cpu")
    # float16: the cpu backend's fused kernels without its FP8 ones (seconds fewer to check)
    fresh, cached = cached_check(backend, torch.float16, tmp_path)
    assert not cached and fresh.passed and fresh.checked
    again, cached = cached_check(backend, torch.float16, tmp_path)
    assert cached and again == fresh
    [path] = tmp_path.glob("cpu-*.json")
    saved = json.loads(path.read_text())
    saved["checked"] = saved["checked"][:1]  # what a hand edit (or a forged "passed") does
    path.write_text(json.dumps(saved))
    assert last_results(tmp_path) == []  # doctor does not show it
    rerun, cached = cached_check(backend, torch.float16, tmp_path)
    assert not cached and rerun.checked == fresh.checked  # checked again, and saved again
    assert [r.checked for r in last_results(tmp_path)] == [fresh.checked]


def test_collective_results_are_saved_sealed_and_doctor_shows_them(tmp_path):
    from mtcore.backend.checks.selfcheck import SelfCheck, save
    from mtcore.cli.render import _self_checks

    checked = ["world: all_reduce, broadcast up to 16385 elements"]
    failure = "collectives on rank 1: all_gather (rank order) of 16385 float32 on tp (size 2): x"
    result = SelfCheck("k1", "cpu", "float32", checked, [failure], 0.2, "now", "collectives")
    save(result, tmp_path)
    save(SelfCheck("k2", "cpu", "float32", ["rms_norm (torch-fused, plugin mtcore)"]), tmp_path)
    [path] = tmp_path.glob("cpu-collectives-*.json")
    lines = _self_checks([r.__dict__ for r in last_results(tmp_path)])
    shown = [ln for ln in lines if "collectives of 1 group(s)" in ln]
    assert len(shown) == 1 and f"FAILED: {failure}" in shown[0], lines
    assert any("1 kernel(s), passed" in ln for ln in lines), lines
    saved = json.loads(path.read_text())
    saved["failures"] = []  # a forged "passed"
    path.write_text(json.dumps(saved))
    assert [r.kind for r in last_results(tmp_path)] == ["kernels"]
