"""Exact resume in one process through the trainer: N steps in one go == k steps, stop,
resume, N - k steps (bitwise, fp32, with dropout so the RNG state matters)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from mtcore.training.checkpoint import CheckpointError, read_model_weights, write_model_weights
from mtcore.training.overrides import validate
from mtcore.training.trainer import train


def _config(tiny, tmp_path, **checkpoint):
    return tiny(
        model={"dropout": 0.1},
        training={"steps": 6, "eval_interval": 0, "sample_prompt": None},
        checkpoint={"interval": 3, **checkpoint},
        logging={"tensorboard_dir": None},
    )


def test_resume_is_bitwise_and_async_save_changes_nothing(tiny, tmp_path):
    whole = train(validate(_config(tiny, tmp_path, async_save=True)), stream=io.StringIO())
    first = tmp_path / "checkpoints"
    assert whole.checkpoint == first / "step_000006" and (first / "step_000003").is_dir()

    stream = io.StringIO()
    resumed_config = _config(
        tiny, tmp_path, dir=str(tmp_path / "again"), load=str(first / "step_000003")
    )
    resumed = train(validate(resumed_config), stream=stream)
    assert "resumed from" in stream.getvalue() and "RNG streams restored" in stream.getvalue()
    assert resumed.start_step == 3 and len(resumed.losses) == 3
    assert resumed.losses == whole.losses[3:]  # bitwise
    _, a, _ = read_model_weights(first)
    _, b, _ = read_model_weights(tmp_path / "again")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_weights_only_checkpoint_starts_at_step_zero_with_a_fresh_optimizer(tiny, tmp_path):
    trained = train(validate(_config(tiny, tmp_path, keep_last=1)), stream=io.StringIO())
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step_000006"]  # keep_last=1 dropped step 3
    config, weights, _ = read_model_weights(trained.checkpoint)
    imported = write_model_weights(tmp_path / "imported", weights, config)
    stream = io.StringIO()
    tuned_config = _config(tiny, tmp_path, dir=str(tmp_path / "tuned"), load=str(imported))
    tuned = train(
        validate({**tuned_config, "training": {**tuned_config["training"], "steps": 2}}),
        stream=stream,
    )
    assert "fresh optimizer, step 0" in stream.getvalue()
    assert tuned.start_step == 0 and len(tuned.losses) == 2
    assert tuned.losses[0] < trained.losses[0] - 0.5  # it starts from the trained weights
    # A restart of that job (resume) continues from its own save, not from the import.
    restart_config = {**tuned_config, "checkpoint": {**tuned_config["checkpoint"], "resume": True}}
    restart = train(
        validate({**restart_config, "training": {**tuned_config["training"], "steps": 3}}),
        stream=io.StringIO(),
    )
    assert restart.start_step == 2 and len(restart.losses) == 1


@pytest.mark.parametrize(
    "precision", [{"dtype": "fp16"}, {"dtype": "bf16", "fp8": "hybrid"}], ids=["fp16", "fp8"]
)
def test_low_precision_resume_restores_masters_scaler_and_fp8_history(tiny, tmp_path, precision):
    config = tiny(
        precision=precision,
        training={"steps": 4, "eval_interval": 0, "sample_prompt": None},
        checkpoint={"interval": 2},
        logging={"tensorboard_dir": None},
    )
    whole = train(validate(config), stream=io.StringIO())
    first = tmp_path / "checkpoints" / "step_000002"
    state = json.loads((first / "trainer_state.json").read_text())
    assert state["optimizer"]["step_count"] == 2
    assert (state["loss_scaler"] is not None) == (precision["dtype"] == "fp16")
    config["checkpoint"] = {"dir": str(tmp_path / "again"), "load": str(first)}
    resumed = train(validate(config), stream=io.StringIO())
    assert resumed.losses == whole.losses[2:]  # bitwise (FP8: the amax history came back)
    _, weights, _ = read_model_weights(tmp_path / "again")  # fp32 masters, not the params
    assert any((w.half().float() != w).any() for w in weights.values())


def test_another_model_is_refused_and_a_finished_job_trains_nothing(tiny, tmp_path):
    config = _config(tiny, tmp_path)
    config["training"]["steps"] = 3
    trained = train(validate(config), stream=io.StringIO())
    load = {"dir": str(tmp_path / "next"), "load": str(trained.checkpoint)}

    deeper = {**config, "model": {**config["model"], "num_layers": config["model"]["num_layers"] + 2}}
    with pytest.raises(CheckpointError, match=r"num_layers: checkpoint \d+, config \d+"):
        train(validate({**deeper, "checkpoint": load}), stream=io.StringIO())

    # Another family is refused in one line, before any tensor loads (and the reverse).
    bert = {"family": "bert", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 32}
    data = {**config["data"], "valid_fraction": 0.2}  # nsp needs two held-out documents
    with pytest.raises(CheckpointError, match=r"holds a gpt model, but the config trains a bert"):
        train(validate({**config, "model": bert, "data": data, "checkpoint": load}), stream=io.StringIO())
    bert_job = {**config, "model": bert, "data": data, "checkpoint": {"dir": str(tmp_path / "bert")}}
    bert_job["training"] = {**config["training"], "steps": 1, "sample_prompt": None}
    bert_checkpoint = train(validate(bert_job), stream=io.StringIO()).checkpoint
    gpt_from_bert = {**config, "checkpoint": {"dir": str(tmp_path / "g"), "load": str(bert_checkpoint)}}
    with pytest.raises(CheckpointError, match=r"holds a bert model, but the config trains a gpt"):
        train(validate(gpt_from_bert), stream=io.StringIO())

    # Numerics-only differences load, and are reported; a finished job has nothing to do.
    theta = {**config, "model": {**config["model"], "rope_theta": 500.0}}
    stream = io.StringIO()
    again = train(validate({**theta, "checkpoint": load}), stream=stream)
    assert "model.rope_theta 10000.0 -> 500.0" in stream.getvalue()
    assert "nothing to train: the checkpoint is at step 3" in stream.getvalue()
    assert again.start_step == 3 and again.losses == []
