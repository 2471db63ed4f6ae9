"""The out-of-tree model family (docs/examples/mtcore-example-family) works as documented.

It is pip-installed, as a user would, into a directory of its own (see conftest.py),
then trained through ``mtcore train`` with the example's own config, shortened and
pointed at a tiny corpus: on 4 ranks as tensor parallel 2 x pipeline parallel 2, and
in one process. Nothing in src/mtcore names the family.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

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


@pytest.fixture(scope="module")
def single(site, corpus, tmp_path_factory, hybrid):  # after `hybrid`: one multi-rank job at a time
    out = tmp_path_factory.mktemp("one-process")
    result = train(site, corpus, out, 1, "--parallel.tp", "1", "--parallel.pp", "1",
                   "--checkpoint.dir", "null")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def scalars(out, tag: str) -> dict[int, float]:
    """A TensorBoard scalar of a run, by step (float32, unlike the log's 4 decimals)."""
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


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


def test_tp2_pp2_matches_one_process(hybrid, single):
    """Same seed, same data: every layout starts from the same weights, so the first
    step's loss agrees; its gradient norm and the loss after one update check backward."""
    (hybrid_out, _), (single_out, stdout) = hybrid, single
    assert "1 ranks: tp=1 pp=1" in stdout, stdout
    loss, one_loss = scalars(hybrid_out, "train/loss"), scalars(single_out, "train/loss")
    norm, one_norm = scalars(hybrid_out, "train/grad_norm"), scalars(single_out, "train/grad_norm")
    assert loss[1] == pytest.approx(one_loss[1], rel=1e-5)
    assert norm[1] == pytest.approx(one_norm[1], rel=1e-4)
    assert loss[2] == pytest.approx(one_loss[2], rel=1e-4)
    assert loss[2] < loss[1] - 0.1  # the update did something


def test_generate_loads_the_tp2_pp2_checkpoint(site, hybrid):
    out, _ = hybrid
    result = site.run("-m", "mtcore.cli.main", "generate", out / "checkpoints",
                      "--prompt", "def ", "--max-new-tokens", "6")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def \n")
