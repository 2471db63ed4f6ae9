"""``mtcore plan`` as a user runs it: same refusals as ``mtcore train``, JSON, compare."""

from __future__ import annotations

import json

import pytest

from mtcore.cli.main import main
from mtcore.plan import load_hardware, plan
from mtcore.training.overrides import load_config

DEFAULT = "configs/default.yaml"


def test_a_layout_train_rejects_gets_trains_message(capsys):
    config = load_config(DEFAULT, ["--parallel.tp", "3"])
    with pytest.raises(ValueError) as trainer:
        config.check(6)
    assert (
        main(["plan", DEFAULT, "--gpus", "6", "--hardware", "cpu-host", "--parallel.tp", "3"]) == 2
    )
    err = capsys.readouterr().err
    assert str(trainer.value) in err and "are not divisible by tp=3" in err


def test_a_batch_train_rejects_gets_trains_message(capsys):
    args = ["--training.global_batch_size", "10"]
    with pytest.raises(ValueError) as trainer:
        load_config(DEFAULT, args).check(4)
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host", *args]) == 2
    assert str(trainer.value) in capsys.readouterr().err


def test_json_gives_the_library_numbers(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = plan(load_config(DEFAULT), 4, load_hardware("cpu-host"))
    assert out["memory"]["peak_bytes"] == pytest.approx(expected.peak_memory)
    assert out["time_s"]["total"] == pytest.approx(expected.time.total)
    assert out["layout"]["tp"] == 2 and out["layout"]["pp"] == 2
    assert set(out["time_s"]) >= {"compute", "tp_comm", "bubble", "dp_exposed", "total"}


def test_text_report_names_every_part(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host"]) == 0
    out = capsys.readouterr().out
    for part in ("optimizer state", "activations", "peak", "pipeline bubble", "tp comm", "MFU"):
        assert part in out


def test_compare_shows_layouts_and_the_trainers_refusals(capsys):
    code = main(
        [
            "plan",
            DEFAULT,
            "--gpus",
            "4",
            "--hardware",
            "cpu-host",
            "--compare",
            "tp=2,pp=2",
            "tp=1,pp=2,vpp=2",
            "tp=4,pp=1",
            "zero1,tp=1,pp=1",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "tp2 cp1 pp2 dp1" in out and "tp1 cp1 pp2 dp2 vpp2" in out and "dp4 zero1" in out
    assert "tp=4,pp=1: rejected: 2 key/value heads are not divisible by tp=4" in out


def test_unknown_hardware_lists_the_shipped_ones(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert "A100-80GB" in err and "MTT-S4000" in err and "cpu-host" in err
    assert "H100-SXM (H100, " in err and len(err.strip().splitlines()) == 1


def test_hardware_by_alias_in_any_case_and_listed_in_help(capsys):
    assert main(["plan", DEFAULT, "--gpus", "8", "--hardware", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == "H100-SXM"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "H100-SXM (H100, H100-SXM5" in help_text and "A100-80GB (A100, " in help_text
    assert "MTT-S4000 (S4000)" in help_text and "any case" in help_text


def test_bad_layout_string(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--compare", "tq=2"]) == 2
    assert "use key=value with keys" in capsys.readouterr().err


def test_gpus_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["plan", DEFAULT])
    assert "--gpus N is required" in capsys.readouterr().err


def test_search_prints_why(capsys):
    assert (
        main(["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host", "--search", "--top", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("why:") == 2 and "bubble" in out


def test_the_vision_language_family_is_planned(capsys):
    assert main(["plan", "configs/llava.yaml", "--gpus", "4", "--hardware", "cpu-host"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llava ") and "pipeline stage 0, the fullest of 2" in out


def test_the_default_hardware_without_a_backend(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "H100-SXM" and "hardware_from_backend" not in out


def test_superscript_digits_are_not_counts(capsys):
    """``"²".isdigit()`` is true and ``int("²")`` raises: both ends of that are caught."""
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "configs/default.yaml", "--gpus", "²"])
    assert stopped.value.code == 2
    assert "--gpus needs a whole number >= 1, got '²'" in capsys.readouterr().err
    assert main(["plan", "configs/default.yaml", "--gpus", "4", "--compare", "tp=²"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [(["--dp-overlap", "bogus"], "--dp-overlap needs one of mtcore, none, full, got 'bogus'"),
     (["--grad-reduce-dtype", "fp64"], "--grad-reduce-dtype needs one of fp32, bf16, fp16, got 'fp64'"),
     (["--compare", "tp2,dp_overlap=bogus", "dp4"], "dp_overlap='bogus': give one of mtcore, none, full"),
     (["--compare", "tp2,grad_dtype=fp64", "dp4"], "grad_dtype='fp64': give one of fp32, bf16, fp16")],
)  # fmt: skip
def test_a_bad_option_is_named_as_it_was_typed(capsys, args, said):
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host", *args]) == 2
    assert capsys.readouterr().err.strip() == f"mtcore plan: error: {said}"
