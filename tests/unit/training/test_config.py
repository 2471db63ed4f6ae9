"""Training config: files, overrides, clear errors before anything starts."""

from __future__ import annotations

import pytest
import yaml

from mtcore.cli.main import build_parser
from mtcore.parallel.layout import LayoutError
from mtcore.parallel.pipeline import SplitError
from mtcore.training.config import ConfigError, OptimizerConfig, TrainConfig
from mtcore.training.overrides import load_config, parse_overrides, read_file, validate
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
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'model\.hiden_size' \(known for family gpt: family, vocab_size",
    ):
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
    with pytest.raises(
        ConfigError, match=r"tokenizer has 300 token ids but model\.vocab_size is 260"
    ):
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
    assert (args.config, args.launch.nproc) == ("job.yaml", 2)
    assert args.overrides == ["--training.steps", "5", "--parallel.tp=2"]
    assert build_parser().parse_args(["train"]).config is None


@pytest.mark.parametrize(
    "key",
    ["parallel.tp", "parallel.dp", "parallel.bucket_size", "training.steps", "data.seed",
     "checkpoint.interval", "logging.interval", "precision.fp8_margin", "optimizer.lr"],
)  # fmt: skip
def test_a_boolean_is_not_a_size_or_count(key):
    # pydantic reads True as 1: --parallel.tp true would quietly run tp=1.
    with pytest.raises(ConfigError, match=rf"{key}: must be an? (integer|number), not a boolean"):
        load_config(None, [f"--{key}", "true"])


def test_model_sizes_and_the_layout_reject_booleans_outside_the_config_too():
    from mtcore.models.gpt import GPTConfig
    from mtcore.parallel.layout import LayoutSpec
    from mtcore.parallel.moe import MoESpec

    with pytest.raises(ConfigError, match=r"model\.num_layers: must be an integer"):
        load_config(None, ["--model.num_layers", "false"])
    for build in (
        lambda: LayoutSpec(pp=True),
        lambda: GPTConfig(hidden_size=True),
        lambda: MoESpec(num_experts=True, ffn_size=8),
    ):
        with pytest.raises(ValueError, match="not a boolean"):
            build()
    assert LayoutSpec(tp=2, sequence_parallel=True).sequence_parallel  # a real bool stays


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("optimizer.betas", "[0.9, 1.0]", r"optimizer\.betas: each beta must lie in \[0, 1\)"),
        ("optimizer.betas", "[-0.1, 0.9]", r"optimizer\.betas: each beta must lie in \[0, 1\)"),
        ("optimizer.lr", ".inf", r"optimizer\.lr: Input should be a finite number"),
        ("optimizer.lr", ".nan", r"optimizer\.lr: Input should be a finite number"),
        ("optimizer.min_lr", ".nan", r"optimizer\.min_lr: Input should be a finite number"),
        ("optimizer.eps", ".inf", r"optimizer\.eps: Input should be a finite number"),
    ],
)
def test_optimizer_numbers_must_be_usable(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--{key}", value])
    assert load_config(None, ["--optimizer.betas", "[0.0, 0.999]"]).optimizer.betas == (0.0, 0.999)


def test_a_key_twice_in_a_yaml_file_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("parallel:\n  tp: 2\n  pp: 1\n  tp: 4\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'tp' \(lines 2 and 4\)"):
        load_config(path)
    path.write_text("training: {steps: 3}\nparallel: {tp: 2}\ntraining: {seed: 1}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'training' \(lines 1 and 3\)"):
        load_config(path)
    # A merge key (<<) may be overridden: that is YAML's meaning, not a duplicate.
    path.write_text("base: &b {tp: 2}\nparallel:\n  <<: *b\n  tp: 4\n")
    assert read_file(path)["parallel"] == {"tp": 4}


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    for name in ("job.yaml", "job.toml"):
        path = tmp_path / name
        path.write_bytes(b"training:\n  sample_prompt: '\xff\xfe'\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert str(e.value) == f"config file {path} is not UTF-8 text (byte 28)"


def test_an_empty_config_file_trains_with_the_defaults_and_says_so(tmp_path, capsys):
    from mtcore.cli.main import main

    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert load_config(path) == TrainConfig(logging={"run_name": "empty"})  # named after its file
    # Stopped before any data is read by a backend that does not exist.
    assert main(["train", str(path), "--training.backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert f"mtcore train: note: {path} holds no settings; training with the defaults" in err
    assert "mtcore train: error:" in err


def test_zero_stage_and_its_older_spelling():
    assert validate({"parallel": {"zero1": True}}).parallel.zero_stage == 1
    assert validate({"parallel": {"zero1": True, "zero": 1}}).parallel.zero_stage == 1
    assert load_config(None, ["--parallel.zero", "2"]).parallel.zero_stage == 2
    assert validate({}).parallel.zero_stage == 0
    with pytest.raises(ConfigError, match=r"zero1 is true but parallel\.zero is 2; set only one"):
        validate({"parallel": {"zero1": True, "zero": 2}})
    assert validate({"parallel": {"zero": 3}}).parallel.zero_stage == 3
    with pytest.raises(
        ConfigError, match=r"onebit_adam cannot run with parallel\.zero1 \(zero >= 1\)"
    ):
        validate({"parallel": {"zero": 2}, "optimizer": {"name": "onebit_adam"}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.moe", "{num_experts: 4, ffn_size: 8, routed_scale: .inf}"],
         r"model\.moe\.routed_scale: Input should be a finite number"),
        (["--model.moe", "{num_experts: 4, ffn_size: 8, capacity_factor: .inf}"],
         r"model\.moe\.capacity_factor: Input should be a finite number"),
        (["--model.moe", "{num_experts: 4, ffn_size: 8, aux_loss_coeff: .nan}"],
         r"model\.moe\.aux_loss_coeff: Input should be a finite number"),
        (["--model.moe", "{num_experts: 4, ffn_size: 8, z_loss_coeff: .inf}"],
         r"model\.moe\.z_loss_coeff: Input should be a finite number"),
        (["--model.moe", "{num_experts: 4, ffn_size: 8, bias_update_rate: .inf}"],
         r"model\.moe\.bias_update_rate: Input should be a finite number"),
        (["--model.mla", "{kv_lora_rank: 8, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                         "v_head_dim: 8, latent_norm_eps: .inf}"],
         r"model\.mla\.latent_norm_eps: Input should be a finite number"),
        (["--model.mla", "{kv_lora_rank: true, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                         "v_head_dim: 8}"],
         r"model\.mla\.kv_lora_rank: must be an integer, not a boolean"),
        (["--model.mtp", "{depth: 1, loss_weight: .inf}"],
         r"model\.mtp\.loss_weight: Input should be a finite number"),
        (["--model.mtp", "{depth: true}"], r"model\.mtp\.depth: must be an integer, not a boolean"),
        (["--model.rope_scaling", "{factor: .nan}"],
         r"model\.rope_scaling\.factor: Input should be a finite number"),
    ],
)
def test_settings_nested_in_the_model_refuse_inf_nan_and_booleans(overrides, message):
    """The model's nested settings (MoE, MLA, MTP, RoPE scaling) are as strict as the
    top-level sections: an infinite routed scale or capacity factor, a NaN loss
    coefficient, ``kv_lora_rank: true`` are one line, not a traceback on a rank."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_every_settings_model_of_a_config_is_strict():
    """Every pydantic model a config can hold (the sections, each family's config and
    what is nested in them) refuses inf/NaN and booleans for numbers: it is a ``Section``
    or a ``Settings``. A new nested model that is a plain BaseModel fails here."""
    import typing

    from pydantic import BaseModel

    from mtcore.models import family_names, get_family
    from mtcore.parallel.settings import Settings
    from mtcore.training.config import DataSection, Section

    seen, todo = set(), [TrainConfig, *(get_family(name).config for name in family_names())]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for field in cls.model_fields.values():
            stack = [field.annotation]
            while stack:
                annotation = stack.pop()
                stack.extend(typing.get_args(annotation))
                if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                    todo.append(annotation)
    loose = [cls.__qualname__ for cls in seen - {TrainConfig}
             if not issubclass(cls, Settings | Section | DataSection)
             or cls.model_config.get("allow_inf_nan") is not False]  # fmt: skip
    assert not loose, loose
    assert len(seen) > 12, sorted(c.__qualname__ for c in seen)
