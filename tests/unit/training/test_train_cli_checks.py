"""`mtcore train` refuses before any rank starts: no CONFIG, a checkpoint of another
architecture; and a CPU job without a dtype trains in fp32."""

from __future__ import annotations

import io

import pytest
import yaml

from mtcore.cli.main import main
from mtcore.training.config import ConfigError, TrainConfig
from mtcore.training.overrides import load_config
from mtcore.training.trainer import train


def test_no_config_is_one_line_naming_the_readme_job(capsys):
    assert main(["train", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "no CONFIG given" in err[0] and "mtcore train configs/default.yaml --nproc 4" in err[0]


def test_another_architecture_exits_2_before_the_ranks_start(tiny, tmp_path, capsys):
    config = tiny(training=dict(steps=1, eval_interval=0, sample_tokens=0))
    first = train(TrainConfig.model_validate(config), stream=io.StringIO())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["train", str(path), "--nproc", "2", "--checkpoint.load", str(first.checkpoint),
            "--checkpoint.dir", str(tmp_path / "other"), "--model.hidden_size", "64"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "holds a different model than the config's model section" in lines[0]
    assert "hidden_size: checkpoint 32, config 64" in lines[0]
    assert not (tmp_path / "other").exists()  # no rank ran


def test_cpu_jobs_default_to_fp32_unless_a_dtype_is_given(tiny):
    for precision, shown in (({}, "fp32 on cpu"), ({"dtype": "bf16"}, "bf16 on cpu")):
        config = tiny(training=dict(steps=1, eval_interval=0, sample_tokens=0))
        config["precision"] = precision
        config["checkpoint"] = {"dir": None}
        stream = io.StringIO()
        train(TrainConfig.model_validate(config), stream=stream)
        assert shown in stream.getvalue()


def test_a_run_does_not_write_into_another_runs_checkpoints(tiny, tmp_path):
    def job(name, **checkpoint):
        config = tiny(training=dict(steps=1, eval_interval=0, sample_tokens=0),
                      logging=dict(run_name=name), checkpoint=checkpoint)  # fmt: skip
        return TrainConfig.model_validate(config)

    train(job("first"), stream=io.StringIO())
    with pytest.raises(ConfigError, match=r"holds the checkpoints of run 'first' \(latest "
                       r"step_000001\); this run is 'second'"):  # fmt: skip
        train(job("second"), stream=io.StringIO())
    train(job("first"), stream=io.StringIO())  # the same run again: its own directory
    resumed = job("second", resume=True)  # resuming it is allowed (nothing left to train)
    assert train(resumed, stream=io.StringIO()).start_step == 1


def test_run_name_places_the_outputs_and_defaults_to_the_config_name(tmp_path):
    path = tmp_path / "my-exp.yaml"
    path.write_text("training:\n  steps: 5\n")
    config = load_config(path)
    assert config.logging.run_name == "my-exp"
    assert config.checkpoint.dir == "runs/my-exp/checkpoints"
    assert config.logging.tensorboard_dir == "runs/my-exp/tensorboard"
    named = load_config(path, ["--logging.run_name", "other"])
    assert named.checkpoint.dir == "runs/other/checkpoints"
    assert load_config(None).checkpoint.dir == "runs/gpt/checkpoints"  # the built-in defaults
    with pytest.raises(ConfigError, match="run_name"):
        load_config(path, ["--logging.run_name", ".."])
