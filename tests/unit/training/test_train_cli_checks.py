"""`mtcore train` refuses before any rank starts: no CONFIG, a checkpoint of another
architecture; and a CPU job without a dtype trains in fp32."""

from __future__ import annotations

import io

import pytest
import yaml

from mtcore.cli.main import main
from mtcore.training.checkpoint import CheckpointError
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
    # The same run again over its finished steps: refused too (issue 48 §2), unless asked.
    with pytest.raises(CheckpointError, match=r"holds this config's finished run \(step 1 of 1\)"):
        train(job("first"), stream=io.StringIO())
    train(job("first", overwrite=True), stream=io.StringIO())
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


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        # Refused by the config: setting up the process group alone needs seconds.
        (["--training.collective_timeout_s", "0.01"], "training.collective_timeout_s"),
        (["--training.seed", str(2**63)], "training.seed"),  # overflowed in the ranks
        # Far beyond this host's memory: the bytes needed and available, not an OOM kill.
        (["--model.hidden_size", "16384", "--model.num_layers", "48", "--model.num_heads", "128"],
         "the model does not fit"),
        # An elastic job must run at every node count it allows: dp is fixed here.
        (["--parallel.dp", "{two_nodes}", "--nnodes", "1:2", "--rdzv-endpoint", "node0",
          "--rdzv-id", "j"], "cannot run on 1 node(s), {nproc} ranks (leave parallel.dp unset"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(
    tiny, tmp_path, capsys, arguments, said, nproc
):
    config = tiny(training=dict(steps=1, eval_interval=0, sample_tokens=0, global_batch_size=16,
                                micro_batch_size=2))  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["train", str(path), "--nproc", nproc, "--checkpoint.dir", str(tmp_path / "out")]
    argv += [a.format(two_nodes=2 * int(nproc)) for a in arguments]
    assert main(argv) == 2
    err = capsys.readouterr().err
    # After any data-preparation progress: one line, or the config's own form (a first
    # line naming the file, then a line per key).
    lines = err[err.index("mtcore train: error:") :].strip().splitlines()
    assert len(lines) <= 2, err
    assert said.format(nproc=nproc) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # no rank ran


@pytest.mark.parametrize("flag", ["--nproc", "--max-restarts", "--nnodes"])
def test_counts_that_are_not_numbers_are_refused_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["train", "configs/default.yaml", flag, "²"])  # str.isdigit() says yes
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} needs" in err and "'²'" in err and "Traceback" not in err
