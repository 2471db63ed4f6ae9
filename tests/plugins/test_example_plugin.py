"""The out-of-tree example plugin (docs/examples/mtcore-example-plugin) works as documented.

It is pip-installed, as a user would, into a directory of its own that reaches
the subprocesses through PYTHONPATH; the environment of the test run is left
untouched.
"""

from __future__ import annotations

import json
import textwrap

import pytest


@pytest.fixture(scope="module")
def site(install_example):
    """The example, pip-installed into a --target directory (see conftest.py)."""
    example = install_example("mtcore-example-plugin")
    assert (example.path / "mtcore_example" / "plugin.py").exists()
    return example


def test_mtcore_plugins_lists_the_example(site):
    result = site.run("-m", "mtcore.cli.main", "plugins")
    assert result.returncode == 0, result.stderr
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("mtcore_example ")), None)
    assert line is not None, result.stdout
    assert "mtcore-example-plugin 0.1.0" in line and " ok " in line
    assert "backends: example" in line


def test_select_backend_example_serves_its_own_swiglu(site):
    script = textwrap.dedent(
        """
        import json, torch
        from mtcore.backend import KernelQuery, select_backend
        from mtcore.ops import swiglu

        backend = select_backend("example")
        x = torch.randn(4, 16, dtype=torch.float32)
        table = {
            str(dtype): [(i.name, i.plugin) for i in backend.kernels["swiglu"].select(KernelQuery("cpu", dtype))]
            for dtype in (torch.float32, torch.bfloat16, torch.int64)
        }
        print(json.dumps({
            "name": backend.name,
            "plugin": backend.plugin,
            "c10d": backend.collective.c10d_backend,
            "swiglu": table,
            "matches": torch.allclose(backend.kernels.swiglu(x), swiglu(x), rtol=1e-6, atol=1e-6),
            "auto": select_backend().name,
        }))
        """
    )
    result = site.run("-c", script)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["name"] == "example" and got["plugin"] == "mtcore_example"
    assert got["c10d"] == "gloo"
    assert got["swiglu"]["torch.float32"] == [["sigmoid-swiglu", "mtcore_example"]]
    assert got["swiglu"]["torch.bfloat16"] == [["sigmoid-swiglu", "mtcore_example"]]
    assert got["swiglu"]["torch.int64"] == [["reference", "mtcore"]]  # the predicate declines
    assert got["matches"] is True
    assert got["auto"] == "cpu"  # not an accelerator: never chosen automatically


def test_doctor_shows_the_example_kernel_and_reference_override(site):
    result = site.run("-m", "mtcore.cli.main", "doctor", "--backend", "example", "--json")
    assert result.returncode == 0, result.stderr
    example = next(b for b in json.loads(result.stdout)["backends"] if b["name"] == "example")
    assert example["notes"] and example["plugin"] == "mtcore_example"
    rows = example["details"]["kernels"]["dtypes"]
    assert rows["float32"]["swiglu"]["chosen"][0]["name"] == "sigmoid-swiglu"
    assert rows["float32"]["rms_norm"]["chosen"][0]["name"] == "reference"

    forced = site.run(
        "-m",
        "mtcore.cli.main",
        "doctor",
        "--backend",
        "example",
        env={"MTCORE_KERNELS": "reference"},
    )
    assert forced.returncode == 0, forced.stderr
    swiglu = next(ln for ln in forced.stdout.splitlines() if ln.strip().startswith("swiglu "))
    assert "reference [mtcore]" in swiglu and "sigmoid-swiglu [mtcore_example] (bypassed)" in swiglu


# slow: the third full conformance-kit run; the default suite runs the kit on the cpu
# backend and on `mtcore new-plugin`'s skeleton, and the example's wiring below.
@pytest.mark.slow
def test_conformance_kit_passes_on_the_example(site):
    result = site.run(
        "-m",
        "pytest",
        "--pyargs",
        "mtcore.testing.conformance",
        "--mtcore-backend",
        "example",
        "-q",
        "-p",
        "no:cacheprovider",
        timeout=900,
    )
    assert result.returncode == 0, (
        f"conformance kit failed on 'example':\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
    assert "mtcore conformance: backend example" in result.stdout
