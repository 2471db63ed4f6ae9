"""The conformance kit, run as a vendor runs it: it passes on cpu and fails on a broken backend.

Each test runs ``python -m pytest --pyargs mtcore.testing.conformance`` in a
subprocess (the kit is a pytest plugin; nesting it in this session would mix
the two). The broken backend is a plugin written to ``tmp_path`` and found
through its own ``*.dist-info/entry_points.txt`` on PYTHONPATH: the cpu backend
with one wrong implementation in each contract area (device, collective, kernel,
fp8), so each must fail exactly there. test_conformance_lies.py has the subtler lies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mtcore.backend.checks.collective_checks import CHECK_NAMES
from mtcore.testing.conformance.plugin import AREAS

TIMEOUT_S = 300

BROKEN_PLUGIN = '''
"""A cpu backend with one wrong implementation in every area, for the conformance kit's tests."""

import contextlib

import torch

from mtcore.backend import (
    FP8, BackendSpec, Collective, CpuDevice, KernelImpl, cpu_scaled_mm_pairs,
    gloo_capabilities, hookimpl,
)


class FirstRankBroadcast(Collective):
    def broadcast(self, tensor, src, group=None, async_op=False):
        # wrong: broadcasts from the group's first rank, whatever src says
        return super().broadcast(tensor, self.global_rank(group, 0), group, async_op)


class ForgetfulDevice(CpuDevice):
    @contextlib.contextmanager
    def fork_rng(self):  # wrong: does not restore the outer RNG state
        yield


def rms_norm_without_eps(x, weight, eps=1e-6):  # wrong: ignores eps
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) * weight.float()).to(x.dtype)


@hookimpl
def mtcore_backends():
    return [
        BackendSpec(
            name="cpu-broken",
            device=ForgetfulDevice(),
            collective=FirstRankBroadcast("gloo", gloo_capabilities()),
            # wrong: torch._scaled_mm on the host has no 1x128 block scaling
            fp8=FP8(native_granularities=lambda: cpu_scaled_mm_pairs() | {("1x128", "1x128")}),
            accelerator=False,
        )
    ]


@hookimpl
def mtcore_kernels(backend, device_type):
    if backend != "cpu-broken":
        return []
    return [KernelImpl("rms_norm", rms_norm_without_eps, "no-eps", priority=50)]
'''


def _run_kit(tmp_path: Path, backend: str, extra_path: Path | None = None):
    env = dict(os.environ)
    for var in (
        "MTCORE_BACKEND",
        "MTCORE_KERNELS",
        "MTCORE_PLUGINS",
        "PYTEST_ADDOPTS",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    ):
        env.pop(var, None)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    report = tmp_path / f"{backend}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "mtcore.testing.conformance",
        "--mtcore-backend",
        backend,
        "-q",
    ]
    proc = subprocess.run(
        [*cmd, f"--junitxml={report}", "-p", "no:cacheprovider"],
        cwd=tmp_path,  # away from this project's pytest configuration, as a vendor would be
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            outcomes[f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"] = kind
    return proc, outcomes


def _summary(stdout: str) -> str:
    start = stdout.find("mtcore conformance: backend")
    assert start >= 0, f"no conformance summary in the output:\n{stdout[-3000:]}"
    return stdout[start:]


@pytest.mark.extended
def test_kit_passes_on_cpu(tmp_path):
    proc, outcomes = _run_kit(tmp_path, "cpu")
    out = proc.stdout + proc.stderr
    assert "unrecognized arguments: --mtcore-backend" not in out, (
        "the kit's pytest11 entry point is missing: reinstall mtcore (pip install -e .)"
    )
    assert proc.returncode == 0, out[-6000:]
    summary = _summary(proc.stdout)
    assert "mtcore conformance: backend cpu" in summary
    for area in AREAS:
        assert re.search(rf"^{area}\s+[1-9]\d* passed\s+0 failed", summary, re.M), (
            f"{area} missing:\n{summary}"
        )
    assert [n for n, k in outcomes.items() if k != "passed"] == [], outcomes
    # Every collective check ran on both world sizes, each reported on its own.
    for ws in (2, 4):
        for name in CHECK_NAMES:
            assert outcomes.get(f"test_collective::test_collective[{ws}ranks-{name}]") == "passed"


# slow: the default suite's negative case of the kit is test_conformance_lies.py's.
@pytest.mark.slow
def test_kit_fails_a_broken_backend_exactly_where_it_is_wrong(tmp_path):
    site = tmp_path / "site"
    dist_info = site / "cpu_broken_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (site / "cpu_broken_plugin.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cpu-broken-plugin\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[mtcore.plugins]\ncpu_broken = cpu_broken_plugin\n"
    )

    proc, outcomes = _run_kit(tmp_path, "cpu-broken", extra_path=site)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    failed = {n for n, k in outcomes.items() if k in ("failure", "error")}
    expected = {
        "test_kernels::test_kernel[rms_norm-no-eps-float32]",
        "test_kernels::test_kernel[rms_norm-no-eps-bfloat16]",
        "test_kernels::test_kernel[rms_norm-no-eps-float16]",
        "test_device::test_fork_rng_restores",
        *(
            f"test_collective::test_collective[{ws}ranks-{n}]"
            for ws in (2, 4)
            for n in CHECK_NAMES
            if "broadcast" in n
        ),
        # subgroups broadcast from their last rank; with 2 ranks each group has one rank
        "test_collective::test_collective[4ranks-new_group-subgroups]",
        # the false 1x128 x 1x128 claim; 1x128 x 128x128 (test ids [1x128-128x128-...]) is
        # not claimed, so it takes the fallback and passes
        *(n for n in outcomes if n.startswith("test_fp8::test_scaled_matmul[1x128-e")),
        # the same false claim, with the product narrowed to bf16 or fp16
        *(
            n
            for n in outcomes
            if n.startswith("test_fp8::test_scaled_matmul_into_low_precision[1x128-torch")
        ),
    }
    assert any(n.startswith("test_fp8::test_scaled_matmul[1x128-e") for n in expected), sorted(
        outcomes
    )
    assert outcomes["test_fp8::test_scaled_matmul[1x128-128x128-e4m3xe4m3]"] == "passed"
    assert failed == expected, (
        f"unexpected: {sorted(failed - expected)}; missed: {sorted(expected - failed)}"
    )
    # The reference rms_norm on the same backend passes: the kit blames the implementation.
    assert outcomes["test_kernels::test_kernel[rms_norm-reference-float32]"] == "passed"
    summary = _summary(proc.stdout)
    assert re.search(r"^kernel\s+\d+ passed\s+3 failed", summary, re.M), summary
    assert "kernel: test_kernel[rms_norm-no-eps-float32]" in summary
    assert "rms_norm" in proc.stdout[: proc.stdout.find("mtcore conformance: backend")], (
        "failure text names the op"
    )


def test_unknown_backend_stops_with_one_message(tmp_path):
    proc, outcomes = _run_kit(tmp_path, "no-such-backend")
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "unknown backend 'no-such-backend'" in proc.stdout + proc.stderr
    assert not outcomes or all(k == "passed" for k in outcomes.values())
