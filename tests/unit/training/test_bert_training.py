"""BERT through the trainer in one process: every precision trains, bad input is refused
before training with the key or the numbers named."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest

from mtcore.training.config import ConfigError
from mtcore.training.overrides import validate
from mtcore.training.trainer import train

ROOT = Path(__file__).resolve().parents[3]
BERT = {"family": "bert", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 32}


def _bert(tiny, **sections) -> dict:
    config = tiny(**sections)
    config["model"] = {**BERT, **sections.get("model", {})}
    config["data"]["valid_fraction"] = 0.2  # nsp draws B from another held-out document
    config["training"]["sample_prompt"] = None
    return config


@pytest.mark.parametrize(
    "precision",
    [
        {"dtype": "fp32"},
        {"dtype": "bf16"},
        {"dtype": "fp16"},  # dynamic loss scaling
        {"dtype": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed"},
    ],
    ids=["fp32", "bf16", "fp16", "fp8"],
)
def test_bert_trains_in_every_precision(tiny, precision):
    config = _bert(
        tiny,
        precision=precision,
        model={"dropout": 0.1},
        optimizer={"lr": 3e-3, "warmup_steps": 1},
        training={"steps": 8, "eval_interval": 8},
        checkpoint={"dir": None},
    )
    stream = io.StringIO()
    result = train(validate(config), stream=stream)
    assert all(math.isfinite(x) for x in result.losses), result.losses
    # an untrained model's loss, not divided by fp16's loss scale (it read 1e-4 before)
    assert result.losses[0] > math.log(2) + 1, result.losses
    assert result.losses[-1] < result.losses[0], result.losses
    (step, metrics), = result.val_metrics
    assert step == 8 and set(metrics) == {"loss", "mlm", "pair", "mlm_accuracy", "pair_accuracy"}
    assert 0.0 <= metrics["mlm_accuracy"] <= 1.0 and 0.0 <= metrics["pair_accuracy"] <= 1.0
    log = stream.getvalue()
    assert "mtcore train: BERT" in log and "(mlm " in log and "mlm_accuracy" in log
    assert "sample" not in log  # an encoder does not generate


def test_bad_bert_input_is_refused_before_training(tiny):
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.rope_theta' \(known for family bert"):
        validate(_bert(tiny, model={"rope_theta": 1e4}))
    gpt = tiny()
    gpt["model"]["pair_task"] = "nsp"  # the reverse: a BERT key in a GPT section
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.pair_task' \(known for family gpt"):
        validate(gpt)
    with pytest.raises(ConfigError, match=r"seq_len=4 is too short for \[CLS\] a \[SEP\] b \[SEP\]"):
        train(validate(_bert(tiny, model={"seq_len": 4})), stream=io.StringIO())
    with pytest.raises(ConfigError, match=r"unknown model family 'bret'; known: gpt, bert"):
        validate(_bert(tiny, model={"family": "bret"}))


@pytest.mark.slow
def test_bert_yaml_trains_on_four_ranks(tmp_path, run_mtcore):
    """The shipped BERT job, shortened, through `mtcore train` on the embedded corpus."""
    args = ["train", ROOT / "configs/bert.yaml", "--nproc", "4",
            "--training.steps", "60", "--training.eval_interval", "60",
            "--logging.tensorboard_dir", "null", "--checkpoint.dir", str(tmp_path / "checkpoints"),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.default_corpus_bytes", "1000000"]  # fmt: skip
    run = run_mtcore(*args, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    mlm = [float(x) for x in re.findall(r"^step \d+/60 \| loss [0-9.]+ \(mlm ([0-9.]+)", run.stdout, re.M)]
    assert mlm[-1] < mlm[0] - 1.0, mlm
    assert re.search(r"eval step 60 \| val loss [0-9.]+ .*mlm_accuracy [0-9.]+ \| pair_accuracy", run.stdout)
    assert (tmp_path / "checkpoints" / "step_000060").is_dir()
