"""configs/sft.yaml trains (one process, two steps, a smaller model): the log's trained
tokens are the batch's labels that are not -100, and the loss is the mean over trained
tokens whatever the micro-batch split (micro-batches hold different numbers of them)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from mtcore.training.overrides import load_config
from mtcore.training.trainer import train

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]


def sft_config(chat_set, tmp_path, micro_batch_size: int, steps: int = 1):
    data, tokenizer = chat_set
    overrides = {
        "parallel.tp": 1, "model.hidden_size": 64, "model.num_layers": 2, "model.seq_len": 96,
        "data.paths": f"[{data}]", "data.tokenizer": str(tokenizer),
        "data.cache_dir": str(tmp_path / "cache"), "training.steps": steps,
        "training.global_batch_size": 8, "training.micro_batch_size": micro_batch_size,
        "training.eval_interval": 0, "logging.interval": 1,
        "checkpoint.dir": str(tmp_path / f"ck{micro_batch_size}"),
        "logging.tensorboard_dir": str(tmp_path / "tb"), "logging.progress": "lines",
    }  # fmt: skip
    argv = [f"--{key}={value}" for key, value in overrides.items()]
    return load_config(ROOT / "configs" / "sft.yaml", argv)


def test_sft_yaml_trains_and_logs_its_trained_tokens(chat_set, tmp_path):
    from mtcore.models import family_of

    config = sft_config(chat_set, tmp_path, micro_batch_size=8, steps=2)
    log = io.StringIO()
    whole = train(config, stream=log)
    trained = [int(n.replace(",", "")) for n in re.findall(r"\| ([\d,]+) trained tokens/step", log.getvalue())]  # fmt: skip
    data = family_of(config.model).data(config.data, config.model)
    loader = data.loader(
        data.train, micro_batch_size=8, global_batch_size=8, seed=config.training.seed
    )
    expected = [int((next(loader)["labels"] != -100).sum()) for _ in range(2)]
    assert trained == expected and 0 < expected[0] < 8 * 96
    # The chat template travels with the checkpoint, beside tokenizer.json.
    saved = json.loads((whole.checkpoint / "tokenizer_config.json").read_text())
    own = json.loads((chat_set[1] / "tokenizer_config.json").read_text())
    assert saved == own and "<|im_start|>" in saved["chat_template"]
    small = data.loader(
        data.train, micro_batch_size=2, global_batch_size=8, seed=config.training.seed
    )
    counts = {int((next(small)["labels"] != -100).sum()) for _ in range(4)}
    assert len(counts) > 1  # a mean of the micro-batches' means would differ
    split = train(sft_config(chat_set, tmp_path, micro_batch_size=2), stream=io.StringIO())
    # Four micro-batches of unequal trained counts give the same token mean as one.
    assert split.losses[0] == pytest.approx(whole.losses[0], rel=1e-5)
