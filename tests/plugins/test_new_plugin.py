"""`mtcore new-plugin NAME`: bad input is refused in one line, and the skeleton it writes
passes the conformance kit as generated.

The skeleton (``--device-type cpu --c10d gloo``, so that it runs here) is generated once,
pip-installed as a user would into a --target directory of its own (``install_example``
in conftest.py), and reached by subprocesses through PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

import pytest
import torch

from mtcore.cli.main import main
from mtcore.ops import REFERENCE_OPS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NAME = "new_accel"  # an underscore: the package, distribution and class names all derive
PACKAGE = f"mtcore_{NAME}"
SKELETON_FILES = {
    "pyproject.toml",
    "README.md",
    f"{PACKAGE}/__init__.py",
    f"{PACKAGE}/plugin.py",
    f"{PACKAGE}/kernels.py",
    "tests/test_conformance.py",
}
KIT_TIMEOUT_S = 900
# The generated plugin and the core only: what is checked is the skeleton, and another
# installed plugin that is broken must not decide the outcome (`mtcore plugins` still
# lists everything).
ONLY_THE_SKELETON = {"MTCORE_PLUGINS": PACKAGE}


def new_plugin(*args: str) -> int:
    return main(["new-plugin", *args])


def written(root) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


# -- what it writes ----------------------------------------------------------------------
def test_default_skeleton_files_and_metadata(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert new_plugin(NAME) == 0
    root = tmp_path / f"mtcore-{NAME}"
    assert written(root) == SKELETON_FILES
    assert f"pip install -e mtcore-{NAME}" in capsys.readouterr().out

    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert project["project"]["name"] == "mtcore-new-accel"
    assert project["project"]["entry-points"]["mtcore.plugins"] == {PACKAGE: f"{PACKAGE}.plugin"}
    torch_req = next(r for r in project["project"]["dependencies"] if r.startswith("torch"))
    assert re.fullmatch(r"torch>=[\d.]+,<[\d.]+", torch_req), torch_req  # a range
    assert project["tool"]["setuptools"]["packages"] == [PACKAGE]

    plugin = (root / PACKAGE / "plugin.py").read_text()
    assert f'DEVICE_TYPE = "{NAME}"' in plugin  # --device-type defaults to NAME
    assert 'C10D_BACKEND = "gloo"' in plugin
    assert "class NewAccelDevice(TorchModuleDevice):" in plugin
    assert "DeviceModuleSpec(" in plugin
    for source in (root / PACKAGE).glob("*.py"):
        compile(source.read_text(), str(source), "exec")


def test_the_kernel_has_the_reference_signature_and_numbers(tmp_path):
    assert new_plugin(NAME, "--dest", str(tmp_path / "p")) == 0
    path = tmp_path / "p" / PACKAGE / "kernels.py"
    spec = importlib.util.spec_from_file_location("generated_kernels", path)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)

    reference = REFERENCE_OPS["swiglu"]
    assert list(inspect.signature(kernels.swiglu).parameters) == list(
        inspect.signature(reference).parameters
    )
    (impl,) = kernels.kernel_impls("cpu")
    assert (impl.op, impl.fn, impl.name) == ("swiglu", kernels.swiglu, f"{NAME}-swiglu")
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(kernels.swiglu(x), reference(x))
    with pytest.raises(ValueError, match="even last dim"):
        kernels.swiglu(torch.randn(3, 7))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["My-Accel"], "did you mean 'my_accel'"),
        (["1accel"], "is not a backend name"),
        (["cpu"], "mtcore's built-in backend"),
        (["accel", "--device-type", "Acc-1"], "--device-type 'Acc-1' is not a torch device type"),
        (["accel", "--c10d", "two words"], "--c10d 'two words' is not a c10d backend name"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert new_plugin(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtcore new-plugin: error: ") and message in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_needs_force(tmp_path, capsys):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "NOTES.txt").write_text("keep me")
    assert new_plugin(NAME, "--dest", str(dest)) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert written(dest) == {"NOTES.txt"}

    assert new_plugin(NAME, "--dest", str(dest), "--force") == 0
    plugin = dest / PACKAGE / "plugin.py"
    fresh = plugin.read_text()
    plugin.write_text("# edited\n")
    assert new_plugin(NAME, "--dest", str(dest), "--force") == 0
    assert plugin.read_text() == fresh  # the skeleton's files are replaced ...
    assert (dest / "NOTES.txt").read_text() == "keep me"  # ... the others kept
    assert written(dest) == SKELETON_FILES | {"NOTES.txt"}


# -- the generated plugin, installed ------------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The skeleton for the host, as generated (no TODO filled in)."""
    root = tmp_path_factory.mktemp("new-plugin") / f"mtcore-{NAME}"
    assert new_plugin(NAME, "--device-type", "cpu", "--c10d", "gloo", "--dest", str(root)) == 0
    return root


@pytest.fixture(scope="module")
def site(install_example, generated):
    """The generated plugin, pip-installed into a --target directory (see conftest.py)."""
    installed = install_example(generated)
    assert (installed.path / PACKAGE / "plugin.py").exists()
    return installed


def test_mtcore_plugins_shows_it_ok(site):
    result = site.run("-m", "mtcore.cli.main", "plugins")
    assert result.returncode == 0, result.stderr
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith(f"{PACKAGE} ")), None)
    assert line is not None, result.stdout
    assert " ok " in line and f"backends: {NAME}; contributes kernels" in line, line


def test_doctor_shows_its_kernel_serving_swiglu(site):
    result = site.run("-m", "mtcore.cli.main", "doctor", "--backend", NAME, env=ONLY_THE_SKELETON)
    assert result.returncode == 0, result.stdout + result.stderr
    swiglu = [ln for ln in result.stdout.splitlines() if ln.strip().startswith("swiglu ")]
    assert swiglu and all(f"{NAME}-swiglu [{PACKAGE}]" in ln for ln in swiglu), swiglu


# slow: test_the_generated_tests_pass runs the same kit on the skeleton, through the
# test file `mtcore new-plugin` writes.
@pytest.mark.slow
def test_the_conformance_kit_passes_as_generated(site):
    result = site.run(
        "-m",
        "pytest",
        "--pyargs",
        "mtcore.testing.conformance",
        "--mtcore-backend",
        NAME,
        "-q",
        "-p",
        "no:cacheprovider",
        env=ONLY_THE_SKELETON,
        timeout=KIT_TIMEOUT_S,
    )
    report = f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"the kit failed on the generated plugin:\n{report}"
    assert f"mtcore conformance: backend {NAME}" in result.stdout
    for area in ("device", "collective", "kernel", "fp8"):  # every area ran, none failed
        counts = re.search(rf"^{area}\s+(\d+) passed\s+(\d+) failed", result.stdout, re.MULTILINE)
        assert counts and int(counts[1]) > 0 and int(counts[2]) == 0, (area, report)


@pytest.mark.extended
def test_the_generated_tests_pass(site, generated):
    result = site.run(
        "-m",
        "pytest",
        str(generated / "tests" / "test_conformance.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(generated),
        env=ONLY_THE_SKELETON,
        timeout=KIT_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "2 passed" in result.stdout
