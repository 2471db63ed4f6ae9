"""The out-of-tree model family (docs/examples/mtcore-example-family) works as documented.

It is pip-installed, as a user would, into a directory of its own (see conftest.py),
then trained through ``mtcore train`` with the example's own config, shortened and
pointed at a tiny corpus, on 4 ranks as tensor parallel 2 x pipeline parallel 2; its
own equivalence test (mtcore's harness: every layout against one process) passes, and
``mtcore plan`` refuses it in one line (it has no planner shape). Nothing in src/mtcore
names the family.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# Family plugins are checked in the default suite (tests/unit/models/test_family_contract.py);
# this example's own install, training and doctor run in CI after make test (make
# test-extended).
pytestmark = pytest.mark.extended

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "mtcore-example-family"
CONFIG = EXAMPLE / "gmlp.yaml"
STEPS = 8
LOSS_LINE = re.compile(rf"^step (\d+)/{STEPS} \| loss ([0-9.]+)", re.MULTILINE)


@pytest.fixture(scope="module")
def site(install_example):
    example = install_example("mtcore-example-family")
    assert (example.path / "mtcore_example_family" / "plugin.py").exists()
    return example


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Repetitive code-like documents: a tiny model's loss falls within a few steps."""
    root = tmp_path_factory.mktemp("family-corpus")
    names = ["alpha", "beta", "gamma", "delta", "token", "layer"]
    for i in range(12):
        body = "".join(
            f"def {names[(i + j) % 6]}_{names[j % 6]}(self, x):\n    return self.{names[j % 5]} + x\n"
            for j in range(40)
        )
        (root / f"doc{i:02d}.py").write_text(body)
    return root


def train(site, corpus, out, nproc: int, *overrides: str):
    """``mtcore train gmlp.yaml`` for a few steps on ``corpus``, every step logged."""
    return site.run(
        "-m", "mtcore.cli.main", "train", CONFIG, "--nproc", str(nproc),
        "--model.seq_len", "32", "--data.paths", f"[{corpus}]", "--data.vocab_size", "300",
        "--data.cache_dir", corpus.parent / "cache", "--training.steps", str(STEPS),
        "--training.global_batch_size", "8", "--training.micro_batch_size", "2",
        "--training.eval_interval", "0", "--training.eval_batches", "1",
        "--training.sample_tokens", "8", "--logging.interval", "1",
        "--logging.tensorboard_dir", out / "tensorboard", *overrides,
        env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip


@pytest.fixture(scope="module")
def hybrid(site, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2-pp2")
    result = train(site, corpus, out, 4, "--parallel.tp", "2", "--parallel.pp", "2",
                   "--checkpoint.dir", out / "checkpoints")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def test_doctor_lists_gmlp_as_a_plugin_family(site):
    result = site.run("-m", "mtcore.cli.main", "doctor", "--json")
    assert result.returncode == 0, result.stderr
    models = json.loads(result.stdout)["models"]
    assert models["error"] is None
    family = next(f for f in models["families"] if f["name"] == "gmlp")
    assert family["source"] == "plugin" and family["generates"] and family["hf"] == []
    assert "gMLP" in family["description"]

    text = site.run("-m", "mtcore.cli.main", "doctor")
    assert re.search(r"^  gmlp +plugin +causal gMLP .*\(no hf adapter; generates\)$", text.stdout, re.M), text.stdout

    # `mtcore plugins` names the family too (a family-only plugin provides no backend).
    listed = site.run("-m", "mtcore.cli.main", "plugins")
    line = next(x for x in listed.stdout.splitlines() if x.startswith("mtcore_example_family"))
    assert line.endswith("backends: none; model families: gmlp"), listed.stdout
    entries = json.loads(site.run("-m", "mtcore.cli.main", "plugins", "--json").stdout)["plugins"]
    assert next(e for e in entries if e["name"] == "mtcore_example_family")["families"] == ["gmlp"]


def test_trains_under_tp2_pp2_and_writes_a_checkpoint(hybrid):
    out, stdout = hybrid
    assert "mtcore train: gMLP (causal)" in stdout and "4 ranks: tp=2 pp=2" in stdout, stdout
    losses = [float(m.group(2)) for m in LOSS_LINE.finditer(stdout)]
    assert len(losses) == STEPS, stdout
    assert losses[-1] < losses[0] - 0.5, losses
    assert re.search(rf"^eval step {STEPS} \| val loss [0-9.]+ .*\| accuracy 0\.\d+$", stdout, re.M)
    step_dir = out / "checkpoints" / f"step_{STEPS:06d}"
    assert (step_dir / "manifest.json").is_file(), stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == step_dir.name
    assert "sample (8 tokens after 'def '):" in stdout


def test_its_own_equivalence_test_passes(site):
    """The family's tests/test_equivalence.py (mtcore.testing.equivalence: tp2, tp2+sp,
    pp2 x vpp2, dp2 ZeRO-1 and tp2 x pp2 against one process) passes where it is installed."""
    result = site.run("-m", "pytest", "-q", "-p", "no:cacheprovider", EXAMPLE / "tests",
                      env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\b6 passed\b", result.stdout), result.stdout[-2000:]


def test_plan_refuses_a_family_without_a_shape_in_one_line(site):
    result = site.run("-m", "mtcore.cli.main", "plan", CONFIG, "--gpus", "4")
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "does not model the 'gmlp' family" in result.stderr, result.stderr


def test_generate_loads_the_tp2_pp2_checkpoint(site, hybrid):
    out, _ = hybrid
    result = site.run("-m", "mtcore.cli.main", "generate", out / "checkpoints",
                      "--prompt", "def ", "--max-new-tokens", "6")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def \n")
