"""Training config: files, overrides, clear errors before anything starts."""

from __future__ import annotations

import pytest
import yaml

from mtcore.cli.main import build_parser
from mtcore.distributed import LayoutError
from mtcore.parallel.pipeline import SplitError
from mtcore.training.config import ConfigError, OptimizerConfig, TrainConfig
from mtcore.training.overrides import load_config, parse_overrides, validate
from mtcore.training.trainer import prepare


def _write(tmp_path, data, name="job.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_overrides_are_typed_yaml_values():
    got = parse_overrides(["--parallel.tp", "2", "--training.steps=5", "--parallel.dp", "null",
                           "--optimizer.betas", "[0.9, 0.99]", "--training.sample_prompt", "def f"])  # fmt: skip
    assert got == [
        ("parallel.tp", 2),
        ("training.steps", 5),
        ("parallel.dp", None),
        ("optimizer.betas", [0.9, 0.99]),
        ("training.sample_prompt", "def f"),
    ]
    with pytest.raises(ConfigError, match=r"--training\.steps has no value"):
        parse_overrides(["--training.steps"])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_overrides(["stray"])


def test_file_then_overrides(tmp_path):
    path = _write(tmp_path, {"parallel": {"tp": 2, "pp": 2}, "training": {"steps": 7}})
    config = load_config(path, ["--parallel.pp", "1", "--data.paths", "/some/file.txt"])
    assert (config.parallel.tp, config.parallel.pp, config.training.steps) == (2, 1, 7)
    assert config.data.paths == ["/some/file.txt"]  # a single path becomes a list


def test_toml_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nstyle = "gpt2"\nhidden_size = 64\n\n[parallel]\ntp = 2\n')
    config = load_config(path)
    assert (config.model.style, config.model.norm, config.parallel.tp) == ("gpt2", "layernorm", 2)


def test_unknown_override_key_names_the_key_and_what_exists():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--parallel.tpp", "2"])
    assert "unknown config key 'parallel.tpp'" in str(e.value)
    assert "tp, cp, dp, pp" in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'trainig\.steps'"):
        load_config(None, ["--trainig.steps", "2"])
    with pytest.raises(ConfigError, match=r"training\.steps has no sub-keys"):
        load_config(None, ["--training.steps.x", "2"])


def test_unknown_key_in_a_file_names_the_key(tmp_path):
    path = _write(tmp_path, {"model": {"hiden_size": 64}})
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.hiden_size' \(known for family gpt: family, vocab_size"):
        load_config(path)


def test_bad_values_and_files():
    with pytest.raises(ConfigError, match=r"parallel\.tp: Input should be a valid integer"):
        load_config(None, ["--parallel.tp", "two"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/job.yaml")
    with pytest.raises(ConfigError, match=r"data.seq_len=64 differs from model.seq_len=256"):
        validate({"data": {"seq_len": 64}})
    with pytest.raises(ConfigError, match=r"vpp=2 .* needs pp > 1"):
        validate({"parallel": {"vpp": 2}})


def test_layout_and_batches_are_checked_against_the_world():
    config = TrainConfig.model_validate({"parallel": {"tp": 2, "pp": 2}})
    spec, m = config.check(4)
    assert (spec.dp, m) == (1, 8)  # 32 sequences / micro-batch 4
    with pytest.raises(LayoutError, match="world size 6 is not divisible by tp\\*cp\\*pp"):
        config.check(6)
    with pytest.raises(LayoutError, match="but the world has 2 ranks"):
        TrainConfig.model_validate({"parallel": {"tp": 2, "dp": 2}}).check(2)
    with pytest.raises(SplitError, match="global batch 10 is not divisible"):
        TrainConfig.model_validate({"training": {"global_batch_size": 10}}).check(1)


def test_prepare_rejects_missing_or_empty_data_and_a_small_vocab(tmp_path, tiny):
    base = tiny()
    missing = validate({**base, "data": {**base["data"], "paths": [str(tmp_path / "nope")]}})
    with pytest.raises(ConfigError, match="data path does not exist"):
        prepare(missing, 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    empty = validate({**base, "data": {**base["data"], "paths": [str(tmp_path / "empty")]}})
    with pytest.raises(ConfigError, match="is empty"):
        prepare(empty, 1)
    small = validate({**base, "model": {**base["model"], "vocab_size": 260}})
    with pytest.raises(ConfigError, match=r"tokenizer has 300 token ids but model\.vocab_size is 260"):
        prepare(small, 1)
    with pytest.raises(ConfigError, match="but the world has 1 ranks"):
        prepare(validate({**base, "parallel": {"tp": 2, "dp": 1}}), 1)
    ok = prepare(validate(base), 1)
    assert ok.model.vocab_size == 384 and ok.microbatches == 2


def test_warmup_then_cosine():
    opt = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert opt.lr_at(1, 110) == pytest.approx(0.1)
    assert opt.lr_at(10, 110) == pytest.approx(1.0)
    assert opt.lr_at(60, 110) == pytest.approx(0.55)
    assert opt.lr_at(110, 110) == pytest.approx(0.1)
    assert opt.lr_at(500, 110) == pytest.approx(0.1)


def test_cli_reads_config_nproc_and_overrides_in_any_order():
    args = build_parser().parse_args(
        ["train", "--training.steps", "5", "job.yaml", "--nproc", "2", "--parallel.tp=2"]
    )
    assert (args.config, args.nproc) == ("job.yaml", 2)
    assert args.overrides == ["--training.steps", "5", "--parallel.tp=2"]
    assert build_parser().parse_args(["train"]).config is None
