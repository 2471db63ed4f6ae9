"""Lies that only show at the sizes real jobs use: the kit fails each, and `mtcore train`
refuses each lie its job calls, in one line with exit 2 (issue 48, sections 3 and 4).

The liars (``lies_at_scale.py``) are one throwaway distribution, pip-installed as a
user would. One kit run covers ``liar_at_scale`` (every area but plugins: the
collective area's spawns are where the large-message lies show), one its FP8 area on
``liar_scales``; then one short job per lie.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from lies_at_scale import LIARS
from test_conformance_lies import TIMEOUT_S, _failure_text, _run_kit

from mtcore.backend import cpu_scaled_mm_pairs

BACKENDS = "liar_at_scale,liar_scales,liar_gather,liar_scatter,liar_mask,liar_saturate,liar_slow"


@pytest.fixture(scope="module")
def liars(install_throwaway_plugin):
    return install_throwaway_plugin(
        "mtcore-liars-at-scale",
        {"mtcore_liars_at_scale/__init__.py": "", "mtcore_liars_at_scale/liars.py": LIARS},
        {"liars_at_scale": "mtcore_liars_at_scale.liars"},
    )


@pytest.mark.extended  # two collective spawns (2 and 4 ranks) and the timing checks: ~1 min
def test_kit_fails_every_lie_at_scale(tmp_path, liars):
    proc, outcomes = _run_kit(
        tmp_path, liars, "liars_at_scale", "--mtcore-backend", "liar_at_scale",
        "--mtcore-area", "device,collective,kernels,fp8",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    failed = {n for n, (kind, _) in outcomes.items() if kind in ("failure", "error")}
    large = [
        f"test_collective::test_collective[{ws}ranks-{op}-large-odd-{dtype}]"
        for ws in (2, 4)
        for op in ("all_gather", "reduce_scatter")
        for dtype in ("float32", "bfloat16")
    ]
    expected = {
        "test_device::test_capabilities",  # memory_bytes 0
        *large,
        "test_kernels::test_kernel[attention-drops-mask-above-64-float32]",
        "test_kernels::test_kernel[fp8_quantize-saturates-at-240-float32]",
        "test_kernels::test_kernel_speed[swiglu-hundred-times-slower-float32]",
        "test_fp8::test_quantize_with_a_scale_at_the_formats_max[e4m3]",
        # every pair the host's torch._scaled_mm runs, each slept on
        *(f"test_fp8::test_native_matmul_speed[{a}]" for a, b in cpu_scaled_mm_pairs() if a == b),
    }
    assert failed == expected, (
        f"unexpected: {sorted(failed - expected)}; missed: {sorted(expected - failed)}\n"
        + out[-4000:]
    )
    # The honest neighbours of each lie pass: small messages, short sequences, e5m2.
    for honest in (
        "test_collective::test_collective[2ranks-all_gather-float32]",
        "test_collective::test_collective[4ranks-reduce_scatter-sum-float32]",
        "test_kernels::test_kernel_speed[attention-drops-mask-above-64-float32]",
        "test_fp8::test_quantize_with_a_scale_at_the_formats_max[e5m2]",
    ):
        assert outcomes[honest][0] == "passed", (honest, _failure_text(outcomes[honest][1]))
    text = {n: _failure_text(outcomes[n][1]) for n in expected}
    assert (
        "causal-long-1x2x129x16"
        in text["test_kernels::test_kernel[attention-drops-mask-above-64-float32]"]
    )
    assert (
        "given-scale-at-max"
        in text["test_kernels::test_kernel[fp8_quantize-saturates-at-240-float32]"]
    )
    slow = text["test_kernels::test_kernel_speed[swiglu-hundred-times-slower-float32]"]
    assert "slow enough to make a job crawl" in slow, slow
    assert "reduce_scatter sum of 65537 elements" in text[large[2]], text[large[2]]
    assert "all_gather block of rank 0" in text[large[0]], text[large[0]]


@pytest.mark.extended
def test_kit_fails_fp8_scales_rounded_to_bfloat16(tmp_path, liars):
    proc, outcomes = _run_kit(
        tmp_path, liars, "liars_at_scale", "--mtcore-backend", "liar_scales", "--mtcore-area", "fp8"
    )
    failed = {n for n, (kind, _) in outcomes.items() if kind in ("failure", "error")}
    assert proc.returncode == 1, proc.stdout[-4000:]
    rounded = {n for n in failed if n.startswith("test_fp8::test_quantize_round_trip")}
    assert rounded and rounded == failed, sorted(failed)
    assert "scale_inv off the reference's" in _failure_text(outcomes[sorted(rounded)[0]][1])


def _job(tmp_path, corpus, backend: str, **sections) -> str:
    config = {
        "model": dict(hidden_size=32, num_layers=1, num_heads=4, seq_len=16),
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "training": dict(steps=1, global_batch_size=2, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None, backend=backend),
        "checkpoint": {"dir": None},
        "logging": dict(tensorboard_dir=None),
    }  # fmt: skip
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


SEQUENCE_PARALLEL = {"parallel": dict(tp=2, sequence_parallel=True)}
FP8_DELAYED = {"precision": dict(fp8="e4m3", fp8_recipe="delayed")}
# backend -> (the job that calls the lie, --nproc, what the one line must name)
JOBS = {
    "liar_gather": (SEQUENCE_PARALLEL, 2, "all_gather (rank order) of 16385 float32 on tp"),
    "liar_scatter": (SEQUENCE_PARALLEL, 2, "reduce_scatter sum of 16385 float32 on tp"),
    "liar_scales": (FP8_DELAYED, 1, "FP8 quantize e4m3 tensor: scale_inv off the reference's"),
    "liar_mask": ({"model": dict(seq_len=128)}, 1, "attention (drops-mask-above-64, plugin"),
    "liar_saturate": (FP8_DELAYED, 1, "fp8_quantize (saturates-at-240, plugin liars_at_scale)"),
    "liar_slow": ({}, 1, "swiglu (hundred-times-slower, plugin liars_at_scale): swiglu:"),
}


@pytest.mark.extended  # six short jobs, two of them on 2 ranks: ~1-2 min on 2 cores
@pytest.mark.parametrize("backend", list(JOBS))
def test_train_refuses_each_lie_it_would_call(tmp_path, liars, write_code_corpus, backend):
    sections, nproc, named = JOBS[backend]
    corpus = write_code_corpus(tmp_path / "docs", n_docs=4, n_lines=10)
    job = _job(tmp_path, corpus, backend, **sections)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(liars.path), env.get("PYTHONPATH")])),
        MTCORE_PLUGINS="liars_at_scale", MTCORE_SELFCHECK_CACHE=str(tmp_path / "selfcheck"),
    )  # fmt: skip
    command = [sys.executable, "-m", "mtcore.cli.main", "train", job, "--nproc", str(nproc)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("mtcore train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"backend {backend!r} failed its self-check" in errors[0], errors[0]
    assert named in errors[0], errors[0]
    assert "step 1" not in proc.stdout
