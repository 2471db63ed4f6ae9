"""The conformance kit fails a plugin that lies subtly, and ``--mtcore-area`` runs one area.

The liars are one throwaway distribution, generated in a tmp dir and
pip-installed as a user would (``install_throwaway_plugin``, conftest.py), with
three plugins:

* ``liar``: backend ``liar`` (the host CPU) whose bf16-only ``rms_norm`` kernel is
  1% high, within the element-wise bf16 tolerance (rtol 1.6e-2), whose float32-only
  ``attention`` ignores document boundaries (packed samples), and whose FP8
  claims the blockwise pair 1x128 x 128x128 native although ``torch._scaled_mm``
  on the host cannot run it (FP8 blockwise training would crash at step 1);
* ``liar_unloadable``: a plugin that fails to import (its vendor runtime is
  missing), which the registry skips with a warning;
* ``liar_misnamed``: a kernel pack whose ``swiglu`` for ``liar`` names its
  parameter ``inp`` instead of the reference op's ``x``.

One kit run covers the first two: ``--mtcore-area`` selects the kernel, fp8 and
plugins areas (the spawned collective checks are not needed), which also proves
the option. The misnamed kernel gets a run of its own, since it stops the
backend from building at all. ``MTCORE_PLUGINS`` keeps every other installed
plugin out of each run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

TIMEOUT_S = 300
BIASED_KERNEL = "rms_norm-one-percent-high-bfloat16"
DOCUMENT_BLIND_KERNEL = "attention-ignores-documents-float32"

LIAR = '''
"""Backend 'liar': honest CPU device and collectives, two subtle lies."""

import torch

from mtcore.backend import (
    FP8, BackendSpec, Collective, CpuDevice, KernelImpl, cpu_scaled_mm_pairs,
    gloo_capabilities, hookimpl,
)
from mtcore.ops import attention as reference_attention


def rms_norm_one_percent_high(x, weight, eps=1e-6):
    # Computed in float32 and rounded once, as the reference does; then 1% high.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * 1.01).to(x.dtype)


def attention_ignoring_documents(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):
    # Right for every unpacked call; a packed sample attends across its documents.
    return reference_attention(q, k, v, causal, key_padding_mask, scale, window, dropout_p,
                               dropout_seeds)


@hookimpl
def mtcore_backends():
    return [
        BackendSpec(
            name="liar",
            device=CpuDevice(),
            collective=Collective("gloo", gloo_capabilities()),
            # The lie: torch._scaled_mm on the host has no block scaling.
            fp8=FP8(native_granularities=lambda: cpu_scaled_mm_pairs() | {("1x128", "128x128")}),
            accelerator=False,
        )
    ]


@hookimpl
def mtcore_kernels(backend, device_type):
    if backend != "liar":
        return []
    return [
        KernelImpl(
            "rms_norm", rms_norm_one_percent_high, "one-percent-high", priority=60,
            predicate=lambda q: q.dtype == torch.bfloat16,
        ),
        KernelImpl(
            "attention", attention_ignoring_documents, "ignores-documents", priority=60,
            predicate=lambda q: q.dtype == torch.float32,
        ),
    ]
'''

MISNAMED = '''
"""A kernel pack for 'liar' whose swiglu breaks the op's contract (parameter name)."""

import torch

from mtcore.backend import KernelImpl, hookimpl


def swiglu_misnamed(inp):  # the reference op's parameter is x
    a, b = inp.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


@hookimpl
def mtcore_kernels(backend, device_type):
    if backend != "liar":
        return []
    return [KernelImpl("swiglu", swiglu_misnamed, "misnamed", priority=60)]
'''


UNLOADABLE = """
import mtcore_liars_vendor_runtime  # not installed: importing this plugin fails
"""


@pytest.fixture(scope="module")
def liars(install_throwaway_plugin):
    return install_throwaway_plugin(
        "mtcore-liars",
        {
            "mtcore_liars/__init__.py": "",
            "mtcore_liars/liar.py": textwrap.dedent(LIAR),
            "mtcore_liars/misnamed.py": textwrap.dedent(MISNAMED),
            "mtcore_liars/unloadable.py": UNLOADABLE,
        },
        {
            "liar": "mtcore_liars.liar",
            "liar_misnamed": "mtcore_liars.misnamed",
            "liar_unloadable": "mtcore_liars.unloadable",
        },
    )


def _run_kit(tmp_path, site, plugins: str, *args: str):
    """The kit in a subprocess, away from this project's pytest configuration, with
    the liars importable and only ``plugins`` loaded: (process, {test id: (outcome,
    junit element)})."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MTCORE_")
        and k not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.path), env.get("PYTHONPATH")]))
    env["MTCORE_PLUGINS"] = plugins
    report = tmp_path / "kit.xml"
    kit = ["-m", "pytest", "--pyargs", "mtcore.testing.conformance", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [sys.executable, *kit, *args, "-q", f"--junitxml={report}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            module = case.get("classname").rsplit(".", 1)[-1]
            outcomes[f"{module}::{case.get('name')}"] = (kind, case)
    return proc, outcomes


def _failure_text(case) -> str:
    return "".join(c.get("message", "") + (c.text or "") for c in case if c.tag == "failure")


def test_kit_fails_the_liars_and_runs_only_the_areas_asked_for(tmp_path, liars):
    proc, outcomes = _run_kit(
        tmp_path, liars, "liar,liar_unloadable", "--mtcore-backend", "liar",
        "--mtcore-area", "kernels", "--mtcore-area", "fp8,plugins",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    failed = {n for n, (kind, _) in outcomes.items() if kind in ("failure", "error")}
    expected = {
        f"test_kernels::test_kernel[{BIASED_KERNEL}]",
        f"test_kernels::test_kernel[{DOCUMENT_BLIND_KERNEL}]",
        "test_fp8::test_scaled_matmul[1x128-128x128-e4m3xe4m3]",
        "test_fp8::test_scaled_matmul[1x128-128x128-e5m2xe4m3]",
        "test_fp8::test_scaled_matmul_into_low_precision[1x128-128x128-torch.bfloat16]",
        "test_fp8::test_scaled_matmul_into_low_precision[1x128-128x128-torch.float16]",
        "test_plugins::test_plugin_is_healthy[liar_unloadable]",
    }
    assert failed == expected, (
        f"unexpected: {sorted(failed - expected)}; missed: {sorted(expected - failed)}\n"
        + out[-4000:]
    )
    # Only the areas asked for ran, each honest part of 'liar' passed.
    assert {n.split("::")[0] for n in outcomes} == {"test_kernels", "test_fp8", "test_plugins"}
    for honest in (
        "test_kernels::test_kernel[rms_norm-reference-bfloat16]",
        "test_fp8::test_scaled_matmul[tensor-e4m3xe4m3]",
        "test_fp8::test_scaled_matmul[1x128-e4m3xe4m3]",
        "test_plugins::test_plugin_is_healthy[liar]",
        "test_plugins::test_plugin_is_healthy[mtcore]",
    ):
        assert outcomes[honest][0] == "passed", (honest, _failure_text(outcomes[honest][1]))

    # Each failure says what the lie is.
    bias = _failure_text(outcomes[f"test_kernels::test_kernel[{BIASED_KERNEL}]"][1])
    mean = re.search(r"mean signed relative error ([-+][0-9.e-]+)", bias)
    assert "systematic bias" in bias and mean and abs(float(mean[1]) - 0.01) < 1e-3, bias
    assert "out of tolerance" not in bias, "the 1% must be within the element-wise tolerance"
    blind = _failure_text(outcomes[f"test_kernels::test_kernel[{DOCUMENT_BLIND_KERNEL}]"][1])
    assert "case 'causal-documents-gqa-2x4/2x13x16' (float32) forward" in blind, blind
    pair = _failure_text(outcomes["test_fp8::test_scaled_matmul[1x128-128x128-e4m3xe4m3]"][1])
    assert "liar declares 1x128 x 128x128 (e4m3 x e4m3) native" in pair, pair
    broken = _failure_text(outcomes["test_plugins::test_plugin_is_healthy[liar_unloadable]"][1])
    assert "mtcore plugin liar_unloadable (mtcore-liars 0.1.0) is broken" in broken, broken
    assert "Traceback (most recent call last)" in broken, broken
    assert "No module named 'mtcore_liars_vendor_runtime'" in broken, broken

    summary = proc.stdout[proc.stdout.find("mtcore conformance: backend liar") :]
    assert "areas: kernel, fp8, plugins (--mtcore-area)" in summary, summary
    assert re.search(r"^plugins\s+\d+ passed\s+1 failed", summary, re.M), summary
    assert not re.search(r"^(device|collective)\s", summary, re.M), summary


def test_kit_fails_on_a_kernel_that_breaks_its_ops_contract(tmp_path, liars):
    proc, outcomes = _run_kit(
        tmp_path, liars, "liar,liar_misnamed", "--mtcore-backend", "liar",
        "--mtcore-area", "plugins",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    # The registry refuses to build a backend that a plugin offered unusable kernels
    # to (a usage error, before any test); were it to build without the plugin, the
    # plugins area would fail instead. Either way the kit fails and says who and why.
    assert proc.returncode in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.TESTS_FAILED), out
    assert "liar_misnamed (mtcore-liars 0.1.0)" in out, out
    assert "Traceback (most recent call last)" in out, out
    assert "kernel 'misnamed' for op 'swiglu' has parameters (inp)" in out, out
    if proc.returncode == pytest.ExitCode.TESTS_FAILED:
        assert outcomes["test_plugins::test_plugin_is_healthy[liar_misnamed]"][0] == "failure"


def test_unknown_area_is_a_usage_error(tmp_path, liars):
    proc, outcomes = _run_kit(
        tmp_path, liars, "liar", "--mtcore-backend", "liar", "--mtcore-area", "kernal"
    )
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "--mtcore-area 'kernal' is not an area of the mtcore conformance kit; the areas are "
        "device, collective, kernel, kernels, fp8, plugins"
    ) in proc.stderr
    assert not outcomes


def test_train_checks_the_backend_first_and_refuses_the_lying_kernel(
    tmp_path, liars, write_code_corpus
):
    """`mtcore train` runs the kit's cases for the kernels it will call before step 1: the
    1%-high bf16 RMSNorm stops it in one line (exit 2); the result is cached for the
    machine, and training.self_check false trains anyway."""
    import yaml

    corpus = write_code_corpus(tmp_path / "docs", n_docs=4, n_lines=10)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": dict(hidden_size=32, num_layers=1, num_heads=4, seq_len=16),
        "precision": {"dtype": "bf16"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "training": dict(steps=1, global_batch_size=2, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None, backend="liar"),
        "checkpoint": {"dir": None},
        "logging": dict(tensorboard_dir=None),
    }))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(liars.path), env.get("PYTHONPATH")])),
        MTCORE_PLUGINS="liar", MTCORE_SELFCHECK_CACHE=str(tmp_path / "selfcheck"),
    )  # fmt: skip
    mtcore = [sys.executable, "-m", "mtcore.cli.main", "train", str(job)]
    for attempt in ("fresh", "cached"):
        proc = subprocess.run(mtcore, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 2, (attempt, proc.stdout[-3000:], proc.stderr[-3000:])
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("mtcore train: error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "backend 'liar' failed its self-check" in errors[0]
        assert "rms_norm (one-percent-high, plugin liar)" in errors[0], errors[0]
        assert "step 1" not in proc.stdout
    assert len(list((tmp_path / "selfcheck").glob("liar-*.json"))) == 1
    doctor = subprocess.run([sys.executable, "-m", "mtcore.cli.main", "doctor"], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert "liar bfloat16 at " in doctor.stdout, doctor.stdout[-3000:]
    assert "FAILED: kernels on rank 0" not in doctor.stdout  # the kernel result, as cached
    assert "FAILED: rms_norm (one-percent-high, plugin liar)" in doctor.stdout
    skipped = subprocess.run([*mtcore, "--training.self_check", "false"], env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "step 1/1" in skipped.stdout
