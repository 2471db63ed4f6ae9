"""T5 through the trainer in one process: it trains (fp32, bf16) on span corruption,
resumes bitwise, refuses another family's checkpoint and lengths the data cannot fill."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest

from mtcore.models.registry import parse_model_config
from mtcore.training.checkpoint.compat import check_model_matches
from mtcore.training.checkpoint.manifest import CheckpointError
from mtcore.training.config import ConfigError
from mtcore.training.overrides import validate
from mtcore.training.trainer import train

ROOT = Path(__file__).resolve().parents[3]
T5 = {
    "family": "t5", "hidden_size": 32, "encoder_layers": 1, "decoder_layers": 1, "num_heads": 4,
    "ffn_hidden_size": 64, "seq_len": 32, "relative_buckets": 8, "relative_max_distance": 16,
}  # fmt: skip


def _t5(tiny, **sections) -> dict:
    config = tiny(**sections)
    config["model"] = {**T5, **sections.get("model", {})}
    config["data"]["valid_fraction"] = 0.2
    config["training"]["sample_prompt"] = None
    return config


@pytest.mark.parametrize(
    "precision",
    [
        {"dtype": "fp32"},
        {"dtype": "bf16"},
        {"dtype": "fp16"},  # dynamic loss scaling
        {"dtype": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed"},  # the block linears
    ],
    ids=["fp32", "bf16", "fp16", "fp8"],
)
def test_t5_trains_on_span_corruption(tiny, precision):
    config = _t5(
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
    assert result.losses[-1] < result.losses[0], result.losses
    ((step, metrics),) = result.val_metrics
    assert step == 8 and set(metrics) == {"loss", "lm", "accuracy"}
    assert "mtcore train: T5" in stream.getvalue() and "1+1 layers" in stream.getvalue()


def test_t5_resumes_bitwise(tiny, tmp_path):
    config = _t5(tiny, model={"dropout": 0.1}, training={"steps": 4, "eval_interval": 0})
    config["checkpoint"] = {"dir": str(tmp_path / "whole"), "interval": 2}
    whole = train(validate(config), stream=io.StringIO())
    first = tmp_path / "whole" / "step_000002"
    assert first.is_dir()
    config["checkpoint"] = {"dir": str(tmp_path / "again"), "load": str(first)}
    resumed = train(validate(config), stream=io.StringIO())
    assert resumed.losses == whole.losses[2:]  # data position, dropout streams, optimizer


def test_another_familys_checkpoint_is_refused_in_one_line(tmp_path):
    t5 = parse_model_config(T5)
    gpt = {"hidden_size": 32, "num_layers": 2, "num_heads": 4}
    with pytest.raises(
        CheckpointError, match=r"holds a gpt model, but the config trains a t5 model"
    ):
        check_model_matches(gpt, t5, tmp_path)
    bert = {"family": "bert", "hidden_size": 32, "num_layers": 2, "num_heads": 4}
    with pytest.raises(CheckpointError, match=r"holds a bert model, but the config trains a t5"):
        check_model_matches(bert, t5, tmp_path)
    deeper = {**T5, "decoder_layers": 3}
    with pytest.raises(CheckpointError, match=r"decoder_layers: checkpoint 3, config 1"):
        check_model_matches(deeper, t5, tmp_path)


def test_lengths_the_data_cannot_fill_are_refused(tiny):
    with pytest.raises(ConfigError, match=r"encoder length 2 cannot hold one corrupted span"):
        validate(_t5(tiny, model={"seq_len": 2}))
    with pytest.raises(ConfigError, match=r"and decoder length 2 cannot hold one corrupted span"):
        validate(_t5(tiny, model={"decoder_seq_len": 2}))


@pytest.mark.slow
def test_t5_yaml_trains_on_four_ranks_and_generates(tmp_path, run_mtcore):
    """The shipped T5 job (tp2 x pp2), shortened, through `mtcore train` on the embedded
    corpus; its checkpoint resumes in one process (resharded) and generates."""
    ckpt = tmp_path / "checkpoints"
    common = ["--logging.tensorboard_dir", "null", "--data.cache_dir", str(tmp_path / "cache"),
              "--data.default_corpus_bytes", "1000000"]  # fmt: skip
    args = ["train", ROOT / "configs/t5.yaml", "--nproc", "4", "--training.steps", "60",
            "--training.eval_interval", "60", "--checkpoint.dir", str(ckpt), *common]  # fmt: skip
    run = run_mtcore(*args, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/60 \| loss ([0-9.]+)", run.stdout, re.M)]
    assert losses[-1] < losses[0] - 2.0, losses
    assert re.search(
        r"eval step 60 \| val loss [0-9.]+ \| lm [0-9.]+ \| accuracy [0-9.]+", run.stdout
    )
    assert (ckpt / "step_000060").is_dir()
    one = ["train", ROOT / "configs/t5.yaml", "--nproc", "1", "--parallel.tp", "1", "--parallel.pp", "1",
           "--training.steps", "62", "--training.eval_interval", "0", "--checkpoint.load", str(ckpt),
           "--checkpoint.dir", str(tmp_path / "one"), "--logging.interval", "1", *common]  # fmt: skip
    resumed = run_mtcore(*one, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"^step 62/62 \| loss [0-9.]+", resumed.stdout, re.M), resumed.stdout
    text = run_mtcore(
        "generate", ckpt, "--prompt", "def <extra_id_0>(self):", "--max-new-tokens", "8"
    )
    assert text.returncode == 0 and text.stdout.strip(), text.stderr
