"""The run's config goes to TensorBoard (and to W&B, offline here when wandb is installed)."""

from __future__ import annotations

import importlib.util
import io
import os

import pytest
import yaml

from mtcore.training.config import ConfigError, TrainConfig
from mtcore.training.trainer import train

_SHORT = dict(steps=2, eval_interval=0, sample_tokens=0)


def test_tensorboard_holds_the_runs_config(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tiny(training=_SHORT, logging=dict(run_name="tb-run"), checkpoint={"dir": None})
    train(TrainConfig.model_validate(config), stream=io.StringIO())
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "config/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    saved = yaml.safe_load("\n".join(line[4:] for line in text.splitlines()))
    assert saved["logging"]["run_name"] == "tb-run"
    assert saved["training"]["steps"] == 2
    assert "train/loss" in events.Tags()["scalars"]
    wall, cpu = (events.Scalars(f"train/{tag}") for tag in ("step_s", "cpu_step_s"))
    assert [e.step for e in cpu] == [1, 2] and all(e.value > 0 for e in cpu)
    cores = len(os.sched_getaffinity(0))  # one process: its threads on the cores it may use
    assert all(c.value <= cores * w.value for c, w in zip(cpu, wall, strict=True))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_refused_before_training(tiny):
    config = tiny(training=_SHORT, logging=dict(wandb=True))
    with pytest.raises(ConfigError, match=r"logging.wandb needs the wandb package: pip install"):
        train(TrainConfig.model_validate(config), stream=io.StringIO())


def test_wandb_offline_run_holds_the_config_and_the_loss(tiny, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tiny(training=_SHORT, logging=dict(wandb=True, wandb_mode="offline", run_name="wb"),
                  checkpoint={"dir": None})  # fmt: skip
    train(TrainConfig.model_validate(config), stream=io.StringIO())
    runs = list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").rglob("*"))
    # The run's log (protobuf records: wandb 0.31 has no Python reader of its own)
    # holds the config section by section as JSON, and the logged losses.
    log = runs[0].read_bytes()
    assert b'{"run_name":"wb","interval":2,' in log
    assert log.count(b"train/loss") >= 2  # steps 1 and 2
