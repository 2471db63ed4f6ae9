"""The `mtcore` command, run as a user runs it: in a fresh process, exit status and output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mtcore.ops import REFERENCE_OPS

MTCORE_ENV = (
    "MTCORE_BACKEND",
    "MTCORE_PLUGINS",
    "MTCORE_DISABLE_PLUGIN_AUTOLOAD",
    "MTCORE_KERNELS",
    "MTCORE_REQUIRE_ACCELERATOR",
)

# A GPU, if the machine has one, must not change what these tests see.
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}

TWIN_PLUGIN = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="twin", device=CpuDevice(), collective=Collective("gloo"),
                        accelerator=False)]
"""

BAD_KERNEL_PLUGIN = """
from mtcore.backend import KernelImpl, hookimpl

def fast_swiglu(inputs):  # the contract is swiglu(x)
    return inputs

@hookimpl
def mtcore_kernels(backend, device_type):
    return [KernelImpl("swiglu", fast_swiglu, "fast")]
"""

PROBE_PLUGIN = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

def facts():
    return {"compiler": "found", "runtime": 3}

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="probe", device=CpuDevice(), collective=Collective("gloo"),
                        accelerator=False, diagnostics=facts)]
"""


def cli_env(env: dict[str, str] | None = None, pythonpath: Path | None = None) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if k not in MTCORE_ENV}
    full.update(HIDE_GPUS)
    full["COLUMNS"] = "120"  # doctor wraps long lines at the terminal width
    full.update(env or {})
    if pythonpath is not None:
        full["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(pythonpath), full.get("PYTHONPATH")])
        )
    return full


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "mtcore.cli.main", *args],
        env=cli_env(env, pythonpath),
        capture_output=True,
        text=True,
        timeout=180,
    )


def make_dist(root: Path, dist: str, module: str, source: str, version: str = "1.0") -> None:
    """A pip-installed distribution as importlib.metadata sees it: module + dist-info."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[mtcore.plugins]\n{module} = {module}\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every command line these tests check, started at once: each one imports torch (seconds)."""
    fakes = tmp_path_factory.mktemp("fake-plugins")
    make_dist(
        fakes,
        "mtcore-broken",
        "broken_plugin",
        "raise ImportError('needs the vendor runtime')\n",
        "2.0",
    )
    make_dist(fakes, "twin-a", "twin_a", TWIN_PLUGIN)
    make_dist(fakes, "twin-b", "twin_b", TWIN_PLUGIN)
    make_dist(
        fakes,
        "typo",
        "typo_plugin",
        TWIN_PLUGIN.replace("def mtcore_backends", "def mtcore_backend"),
    )
    make_dist(fakes, "probe", "probe_plugin", PROBE_PLUGIN)
    badkernel = tmp_path_factory.mktemp("bad-kernel-plugin")
    make_dist(badkernel, "mtcore-badkernel", "badkernel_plugin", BAD_KERNEL_PLUGIN)
    reference = {"MTCORE_KERNELS": "reference"}
    commands = {
        "plugins": (["plugins"], {}, None),
        "doctor": (["doctor"], {}, None),
        "doctor_json": (["doctor", "--json"], {}, None),
        "reference": (["doctor", "--backend", "cpu"], reference, None),
        "nope_json": (["doctor", "--backend", "nope", "--json"], {}, None),
        "unavailable": (["doctor", "--backend", "cuda"], {}, None),
        "fakes": (["doctor"], {}, fakes),
        "fakes_twin_verbose": (["doctor", "--backend", "twin", "--verbose"], {}, fakes),
        "fakes_plugins_json": (["plugins", "--json"], {}, fakes),
        "allowlist": (["doctor"], {"MTCORE_PLUGINS": "mtcore-cuda,no-such-plugin"}, None),
        "no_autoload": (["doctor"], {"MTCORE_DISABLE_PLUGIN_AUTOLOAD": "1"}, None),
        "badkernel": (["doctor"], {}, badkernel),
        "badkernel_json": (["doctor", "--json"], {}, badkernel),
        "require_accelerator": (["doctor"], {"MTCORE_REQUIRE_ACCELERATOR": "1"}, None),
    }

    def run(item):
        args, env, pythonpath = item
        return run_cli(*args, env=env, pythonpath=pythonpath)

    # A few at a time: enough to overlap the imports without crowding a small CI machine.
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(commands, pool.map(run, commands.values()), strict=True))
    return results


@pytest.fixture(scope="module")
def doctor_json(runs) -> dict:
    result = runs["doctor_json"]
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def doctor_text(runs) -> str:
    result = runs["doctor"]
    assert result.returncode == 0, result.stderr
    return result.stdout


def backend(data: dict, name: str) -> dict:
    return next(b for b in data["backends"] if b["name"] == name)


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("mtcore")
    assert script.exists(), f"console script missing next to {sys.executable}; pip install -e ."
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("mtcore "), result


def test_no_command_prints_usage_and_exits_2():
    result = run_cli()
    assert result.returncode == 2
    assert "doctor" in result.stderr and "plugins" in result.stderr


# Run in one fresh process: every call must answer without importing torch (seconds of
# CPU per process); a command imports it inside ``run`` when it builds something.
WITHOUT_TORCH = """
import contextlib, io, json, sys
from mtcore.cli.main import COMMANDS, main

def status(argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return main(argv)
        except SystemExit as e:
            return e.code

calls = [["--help"], ["--version"], [], ["no-such-command"], ["plan", "configs/default.yaml"],
         ["train", "configs/default.yaml", "--model.no_such_key", "1"],
         ["train", "configs/default.yaml", "--nproc", "3"],
         ["train", "configs/default.yaml", "--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint",
          "localhost:29400", "--rdzv-id", "layout"]]
calls += [[name, "--help"] for name in COMMANDS] + [[name, "--no-such-flag"] for name in COMMANDS]
calls += [["plan", f"configs/{name}.yaml", "--gpus", "8", "--hardware", "H100-SXM"]
          for name in ("default", "moe", "bert", "t5", "llava")]
calls += [["plan", "configs/default.yaml", "--gpus", "4", "--hardware", "cpu-host", "--search"]]
seen = []
for argv in calls:
    seen.append((argv, status(argv), "torch" in sys.modules))
print(json.dumps(seen))
"""


def test_help_usage_errors_and_plan_do_not_import_torch():
    """`mtcore --help`, `--version`, every `COMMAND --help`, usage errors and `mtcore plan`
    (a family per config) answer without importing torch."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], cwd=root, env=cli_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    first = next((argv for argv, _, torch_in in seen if torch_in), None)
    assert first is None, f"`mtcore {' '.join(first)}` imported torch"
    statuses = {" ".join(argv): status for argv, status, _ in seen}
    assert statuses["--help"] == statuses["--version"] == statuses["plan --help"] == 0
    assert statuses[""] == statuses["no-such-command"] == statuses["plan configs/default.yaml"] == 2
    assert statuses["train configs/default.yaml --model.no_such_key 1"] == 2
    # A layout the ranks cannot hold (tp2 x pp2 on 3 ranks, or on 2 when one of two
    # nodes is lost) is refused before torch, the backend or the data.
    assert statuses["train configs/default.yaml --nproc 3"] == 2
    elastic = "--nproc 2 --nnodes 1:2 --rdzv-endpoint localhost:29400 --rdzv-id layout"
    assert statuses[f"train configs/default.yaml {elastic}"] == 2
    planned = [k for k in statuses if k.startswith("plan configs/") and "--gpus" in k]
    assert len(planned) == 6 and all(statuses[k] == 0 for k in planned), statuses


def test_plugins_lists_the_cpu_plugin_with_version_status_and_backends(runs):
    result = runs["plugins"]
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("mtcore_cuda "))
    assert "mtcore-cuda 0.1.0" in line and " ok " in line
    assert "backends: cuda" in line and "cpu" not in line
    core = next(ln for ln in result.stdout.splitlines() if ln.startswith("mtcore "))
    assert "mtcore 0.1.0" in core and "backends: cpu" in core


def test_doctor_text_reports_cpu_gloo_kernels_and_unavailable_gpu(doctor_text):
    out = doctor_text
    assert out.startswith("=") and "mtcore doctor" in out.splitlines()[0]
    assert "platform " in out and "mtcore-0.1.0" in out and "torch-" in out and "Python " in out
    assert re.search(r"mtcore_cuda\s+mtcore-cuda 0\.1\.0", out)
    assert "default cpu (automatic)" in out
    cpu_line = next(ln for ln in out.splitlines() if ln.lstrip().startswith("cpu "))
    assert cpu_line.rstrip().endswith("available")
    cuda_line = next(ln for ln in out.splitlines() if ln.lstrip().startswith("cuda "))
    assert "unavailable: no cuda device is visible" in cuda_line
    section = out.split("- backend cpu -", 1)[1]
    assert "c10d backend 'gloo'" in section
    assert "peak TFLOP/s" in section and "unknown" in section
    assert "fp8: available" in section and "1x128" in section
    kernels = section.split("kernels:", 1)[1]
    for op in REFERENCE_OPS:
        assert f"    {op} " in kernels, op
    assert "MTCORE_KERNELS=reference" in kernels


def test_doctor_json_has_every_section(doctor_json):
    data = doctor_json
    assert data["schema"] == 1 and data["command"] == "doctor" and data["error"] is None
    selection = data["selection"]
    assert (selection["backend"], selection["how"], selection["error"]) == ("cpu", "automatic", None)
    # The installed cuda plugin cannot serve on this machine, which has no NVIDIA device
    # files: selection passes it over without a warning, and the backend list says why.
    assert selection["notes"] == []
    cuda = backend(data, "cuda")
    assert not cuda["available"] and "no cuda device is visible" in cuda["reason"]
    cpu = backend(data, "cpu")
    assert cpu["available"] and cpu["plugin"] == "mtcore" and not cpu["accelerator"]
    details = cpu["details"]
    caps = details["capabilities"]
    assert (
        caps["device_type"] == "cpu" and "float32" in caps["dtypes"] and caps["device_count"] == 1
    )
    assert set(caps["peak_tflops"]) >= {"float32", "bfloat16"}
    coll = details["collective"]
    from_2_8 = torch.__version__ >= "2.8"  # gloo's AVG, the CPU torch._scaled_mm
    assert coll["c10d_backend"] == "gloo" and coll["avg_native"] is from_2_8
    assert coll["ops"]["all_reduce"] == {
        "fp32": "native",
        "bf16": "native",
        "fp16": "native",
        "fp8_e4m3": "fallback",
        "fp8_e5m2": "fallback",
    }
    fp8 = details["fp8"]
    assert fp8["available"] and set(fp8["formats"]) == {"e4m3", "e5m2"}
    # tensor-wise: native only where this torch runs torch._scaled_mm on the CPU (2.8 on)
    # and it measured not slower than the fallback on this host
    # (tests/unit/backend/test_fp8_paths.py); blocks: never native.
    measured_faster = "not slower" in fp8["why"]["tensor"]
    assert (fp8["granularities"]["tensor"] == "native") == measured_faster, fp8["why"]
    if not from_2_8:
        assert fp8["why"]["tensor"] == "no native GEMM for this pair here", fp8["why"]
    assert fp8["granularities"]["128x128"].startswith("fallback")
    assert fp8["why"]["128x128"] == "no native GEMM for this pair here"
    assert any("fp8-gemm-paths-" in source for source in fp8["path_sources"]) is from_2_8, fp8
    kernels = details["kernels"]
    assert kernels["forced_reference"] is False
    for dtype in ("float32", "bfloat16"):
        rows = kernels["dtypes"][dtype]
        assert set(rows) == set(REFERENCE_OPS)
        for op, row in rows.items():
            assert row["chosen"], (dtype, op)
            assert row["chosen"][-1]["plugin"], (dtype, op)

    cuda = backend(data, "cuda")
    assert cuda["available"] is False and cuda["reason"] and cuda["details"] is None


def test_kernels_reference_env_is_shown(runs):
    result = runs["reference"]
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "environment: MTCORE_KERNELS=reference" in out
    assert "MTCORE_KERNELS=reference forces the reference implementation" in out
    kernels = out.split("- backend cpu -", 1)[1].split("kernels:", 1)[1]
    for op in REFERENCE_OPS:
        rows = [ln for ln in kernels.splitlines() if ln.startswith(f"    {op} ")]
        assert len(rows) == 2 and all("reference [mtcore]" in r for r in rows), (op, rows)


def test_unknown_backend_fails_naming_the_known_ones(runs):
    result = runs["nope_json"]
    assert result.returncode == 2  # a name no plugin provides: usage, not an unhealthy install
    assert "unknown backend 'nope'" in result.stderr
    assert "known backends:" in result.stderr and "cpu" in result.stderr
    data = json.loads(result.stdout)  # stdout stays one JSON document
    assert data["error"]["type"] == "BackendError" and "nope" in data["error"]["message"]
    assert data["requested"] == "nope"


def test_unavailable_backend_fails_with_the_reason(runs):
    result = runs["unavailable"]
    assert result.returncode == 1
    assert "cannot run here: no cuda device is visible" in result.stderr
    assert "--backend cuda failed" in result.stdout  # the report is still printed


def test_broken_plugin_and_conflict_are_reported_with_exit_1(runs):
    result = runs["fakes"]
    assert result.returncode == 1, result.stderr
    out = result.stdout
    broken = next(ln for ln in out.splitlines() if "broken_plugin " in ln)
    assert "mtcore-broken 2.0" in broken and " broken " in broken
    assert "ImportError: needs the vendor runtime" in broken
    assert "traceback of broken_plugin:" in out and "Traceback (most recent call last)" in out
    assert "ERROR: plugin broken_plugin is broken" in result.stderr
    assert "backend 'twin' is claimed by several plugins" in result.stderr
    assert "CONFLICT: backend 'twin' is claimed by" in out and "twin-a" in out and "twin-b" in out
    assert "PluginWarning" not in result.stderr  # doctor shows it once, in the report
    typo = next(ln for ln in out.splitlines() if "typo_plugin " in ln)
    assert " broken " in typo and "unknown hook 'mtcore_backend'" in typo
    assert "default cpu (automatic)" in out  # the others still work
    assert "compiler: found" in out and "runtime: 3" in out  # the probe backend's diagnostics

    result = runs["fakes_twin_verbose"]
    assert result.returncode == 1 and "claimed by several plugins" in result.stderr
    assert "Traceback (most recent call last)" in result.stdout
    assert "ImportError: needs the vendor runtime" in result.stdout

    listing = json.loads(runs["fakes_plugins_json"].stdout)
    by_name = {p["name"]: p for p in listing["plugins"]}
    assert by_name["broken_plugin"]["status"] == "broken"
    assert by_name["broken_plugin"]["error"]["type"] == "ImportError"
    assert by_name["mtcore_cuda"]["status"] == "ok"
    assert by_name["mtcore_cuda"]["backends"] == ["cuda"]
    assert by_name["twin_a"]["conflicting_backends"] == ["twin"]
    assert by_name["typo_plugin"]["status"] == "broken"
    assert "mtcore_backend" in by_name["typo_plugin"]["error"]["message"]


def test_plugin_switches_are_explained(runs):
    result = runs["allowlist"]
    assert result.returncode == 0, result.stderr
    assert "no-such-plugin  skipped: named in MTCORE_PLUGINS" in result.stdout

    result = runs["no_autoload"]
    assert result.returncode == 0, result.stderr
    assert "mtcore_cuda  skipped: MTCORE_DISABLE_PLUGIN_AUTOLOAD is set" in result.stdout
    assert "default cpu (automatic)" in result.stdout  # the core's own cpu backend
    assert "WARNING" not in result.stdout  # no accelerator plugin loaded: nothing passed over


def test_kernel_breaking_its_contract_fails_doctor_with_the_traceback(runs):
    result = runs["badkernel"]
    assert result.returncode == 1
    out = result.stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("  badkernel_plugin "))
    assert " broken " in line and "'swiglu'" in line and "(inputs)" in line
    assert "traceback of badkernel_plugin:" in out and "KernelRegistrationError" in out
    assert "ERROR: plugin badkernel_plugin is broken" in result.stderr
    assert "1 broken plugin" in out.splitlines()[-1]
    data = json.loads(runs["badkernel_json"].stdout)
    assert runs["badkernel_json"].returncode == 1
    assert data["error"]["type"] == "InstallationError"
    assert "badkernel_plugin" in data["error"]["message"]
    assert "KernelRegistrationError" in data["error"]["traceback"]
    plugin = next(p for p in data["plugins"] if p["name"] == "badkernel_plugin")
    assert plugin["status"] == "broken" and "swiglu" in plugin["error"]["traceback"]
    cpu = backend(data, "cpu")
    assert cpu["error"] is not None and "failed to build" in cpu["error"]["message"]


def test_require_accelerator_makes_the_host_fallback_an_error(runs):
    result = runs["require_accelerator"]
    assert result.returncode == 1 and "MTCORE_REQUIRE_ACCELERATOR is set" in result.stderr
    out = result.stdout
    assert "no default (automatic)" in out
    assert "MTCORE_REQUIRE_ACCELERATOR is set" in out and "no cuda device is visible" in out


def test_the_program_prints_a_python_warning_as_one_line_once(capsys):
    """`mtcore` (its console script) shows a warning as `mtcore CMD: warning: ...`, once,
    without the source line Python prints; in-process ``main`` leaves warnings to Python."""
    import warnings
    from importlib.metadata import entry_points

    from mtcore.cli.main import one_line_warnings

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "mtcore"]
    assert script.value == "mtcore.cli.main:console"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        with one_line_warnings("generate"):
            for _ in range(2):
                warnings.warn("the same thing, twice", UserWarning, stacklevel=1)
            warnings.warn("another", UserWarning, stacklevel=1)
        assert warnings.showwarning is before  # restored
    assert capsys.readouterr().err.splitlines() == [
        "mtcore generate: warning: the same thing, twice",
        "mtcore generate: warning: another",
    ]
