"""`mtcore convert` and `mtcore generate` given bad input: one line and a non-zero exit,
never a traceback, and nothing already on disk overwritten unasked (in process)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtcore.backend import select_backend
from mtcore.cli.main import main
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import import_llama
from mtcore.training.checkpoint import write_model_weights


def _one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def checkpoint(tmp_path):
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, seq_len=16)
    weights = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
    return write_model_weights(tmp_path / "ckpt", weights, config)


def test_to_hf_refuses_a_file_and_an_existing_model_unless_forced(tmp_path, checkpoint, capsys):
    file = tmp_path / "a-file"
    file.write_text("mine")
    assert main(["convert", "to-hf", str(checkpoint), str(file)]) == 2
    assert "is a file, not a directory" in _one_error_line(capsys, "mtcore convert to-hf: error:")
    assert file.read_text() == "mine"

    out = tmp_path / "hf"
    assert main(["convert", "to-hf", str(checkpoint), str(out), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    (out / "README.md").write_text("notes")
    before = (out / "model.safetensors").read_bytes()
    assert main(["convert", "to-hf", str(checkpoint), str(out), "--dtype", "bf16"]) == 2
    err = _one_error_line(capsys, "mtcore convert to-hf: error:")
    assert "already holds a model" in err and "--force" in err
    assert (out / "model.safetensors").read_bytes() == before

    assert main(["convert", "to-hf", str(checkpoint), str(out), "--dtype", "bf16", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (out / "model-00001-of-00002.safetensors").exists()  # would be read with it
    assert (out / "README.md").read_text() == "notes"  # not a model file: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ckpt", "hf"]  # no staging


def test_from_hf_refuses_nan_or_inf_weights_naming_the_tensor(tmp_path, checkpoint, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(checkpoint), str(hf), "--dtype", "fp32"]) == 0
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = float("inf")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    _, imported = import_llama(hf)
    bad = [k for k, v in imported.items() if not torch.isfinite(v).all()]
    assert len(bad) == 1
    capsys.readouterr()
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "root")]) == 2
    err = _one_error_line(capsys, "mtcore convert from-hf: error:")
    assert f"weight {bad[0]!r} holds 1 NaN or inf value(s)" in err
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "nan", "--top-k", "5"], "--temperature must be a finite number > 0"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0"),
        (["--temperature", "-1"], "--temperature must be a finite number > 0"),
        (["--seed", str(2**64)], "--seed must fit in 64 bits"),
        (["--backend", "nope"], "'nope'"),
    ],
)
def test_generate_bad_arguments_are_one_line_and_exit_2(
    tmp_path, checkpoint, capsys, args, message
):
    assert main(["generate", str(checkpoint), "--prompt", "x", *args]) == 2
    assert message in _one_error_line(capsys, "mtcore generate: error:")


def test_generate_refuses_what_is_not_a_checkpoint_in_one_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "no checkpoint at" in _one_error_line(capsys, "mtcore generate: error:")
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "no committed checkpoint" in _one_error_line(capsys, "mtcore generate: error:")


def test_convert_names_the_directory_asked_for_when_it_cannot_write(tmp_path, checkpoint, capsys):
    """Root only (mounts): a read-only directory is bad input (exit 2, before anything is
    read); a disk that fills up mid-export is a failure (exit 1). Either way the line names
    the directory given, not the staging directory beside it, which is gone."""
    import subprocess

    small, read_only = tmp_path / "small", tmp_path / "ro"
    small.mkdir()
    read_only.mkdir()
    mounts = [(small, "size=16k"), (read_only, "ro,size=16k")]
    for where, options in mounts:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True)  # fmt: skip
        if made.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        assert main(["convert", "to-hf", str(checkpoint), str(read_only / "hf")]) == 2
        err = _one_error_line(capsys, "mtcore convert to-hf: error:")
        assert f"OUT_DIR {read_only / 'hf'} is not writable" in err
        assert main(["convert", "from-hf", str(tmp_path / "no-model"), str(read_only / "ck")]) == 2
        assert "OUT_ROOT" in _one_error_line(capsys, "mtcore convert from-hf: error:")

        assert (
            main(["convert", "to-hf", str(checkpoint), str(small / "hf"), "--dtype", "fp32"]) == 1
        )
        err = _one_error_line(capsys, "mtcore convert to-hf: error:")
        assert f"cannot write {small / 'hf'}: " in err and "o space left on device" in err, err
        assert ".hf." not in err  # the staging directory is not what the user asked for
        assert list(small.iterdir()) == []  # nothing half-written left
    finally:
        for where, _ in mounts:
            subprocess.run(["umount", str(where)], check=True)
