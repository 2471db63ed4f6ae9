"""Checkpoint files in one process: weights round trip, manifest checks, safe loading,
uncommitted saves, retention."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.training.checkpoint import (
    CheckpointError,
    IncompleteCheckpointWarning,
    load_model,
    read_model_weights,
    resolve_checkpoint,
    write_model_weights,
)
from mtcore.training.checkpoint.manifest import apply_retention, committed_steps
from mtcore.training.checkpoint.safe_reader import load_metadata

CONFIG = GPTConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16, vocab_size=64
)


@pytest.fixture
def weights():
    model = GPT(CONFIG, single_context(CONFIG, select_backend("cpu"), seed=3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weights_round_trip_splits_fused_params_into_sections(tmp_path, weights):
    directory = write_model_weights(tmp_path / "ck", weights, CONFIG, step=7)
    assert (
        directory.name == "step_000007"
        and (tmp_path / "ck" / "latest").read_text() == "step_000007\n"
    )
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["kind"] == "weights" and manifest["step"] == 7
    # q, k, v of the fused QKV and gate/up of fc1 are separate logical tensors
    assert manifest["sections"]["layers.1.attn.qkv.weight"] == {"dim": 0, "sizes": [32, 16, 16]}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"])
    config, back, step = read_model_weights(tmp_path / "ck")
    assert config == CONFIG and step == 7 and set(back) == set(weights)
    for name, value in weights.items():
        assert torch.equal(back[name], value), name
    model, step, found = load_model(directory, select_backend("cpu"))
    assert step == 7 and found == directory and not model.training


def test_flipped_byte_and_truncation_are_errors_naming_the_file(tmp_path, weights):
    directory = write_model_weights(tmp_path / "ck", weights, CONFIG)
    data = directory / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupted"):
        read_model_weights(directory)
    data.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated"):
        read_model_weights(directory)
    (directory / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable"):
        read_model_weights(directory)


def test_metadata_unpickling_refuses_anything_but_dcp_records(tmp_path, weights):
    directory = write_model_weights(tmp_path / "ck", weights, CONFIG)
    assert load_metadata(directory / ".metadata").state_dict_metadata  # the real one loads

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    evil = tmp_path / "evil.metadata"
    evil.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle (posix|os)\.system"):
        load_metadata(evil)


def test_uncommitted_saves_are_ignored_and_reported(tmp_path, weights):
    root = tmp_path / "ck"
    write_model_weights(root, weights, CONFIG, step=2)
    (root / "step_000004.partial").mkdir()  # a save killed before its commit
    (root / "step_000004.partial" / "__0_0.distcp").write_bytes(b"half")
    (root / "step_000006").mkdir()  # a step directory without a manifest
    with pytest.warns(IncompleteCheckpointWarning) as caught:
        assert resolve_checkpoint(root).name == "step_000002"
    reported = " ".join(str(w.message) for w in caught)
    assert "step_000004.partial" in reported and "step_000006 " in reported
    with pytest.raises(CheckpointError, match="incomplete save"):
        resolve_checkpoint(root / "step_000004.partial")
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        read_model_weights(root / "step_000006")


def test_keep_last_k_keeps_the_newest_and_drops_older_partials(tmp_path, weights):
    root = tmp_path / "ck"
    for step in (1, 2, 3, 4):
        write_model_weights(root, weights, CONFIG, step=step)
    (root / "step_000002.partial").mkdir()
    apply_retention(root, keep_last=2)
    assert [s for s, _ in committed_steps(root)] == [3, 4]
    assert not (root / "step_000002.partial").exists()
    assert resolve_checkpoint(root).name == "step_000004"


def test_a_symbolic_link_in_a_checkpoint_is_refused_not_followed(tmp_path, weights, capsys):
    """A link would have a load read a file outside the checkpoint: refused by name, for
    generate and resume alike (both verify), even when the target's bytes match."""
    from mtcore.cli.main import main

    directory = write_model_weights(tmp_path / "ck", weights, CONFIG, step=1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = next(directory.glob("*.distcp"))
    (outside / shard.name).write_bytes(shard.read_bytes())  # the same bytes: checksums pass
    shard.unlink()
    shard.symlink_to(outside / shard.name)
    with pytest.raises(CheckpointError, match=rf"checkpoint file {shard} is a symbolic link"):
        read_model_weights(directory)
    assert main(["generate", str(directory), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and err.count("\n") == 1, err

    intact = write_model_weights(tmp_path / "intact", weights, CONFIG, step=1)
    read_model_weights(intact)  # loads, as itself; through a link it does not
    linked_step = tmp_path / "linked" / "step_000001"
    linked_step.parent.mkdir()
    linked_step.symlink_to(intact)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_model_weights(linked_step)
