"""Structural damage to a checkpoint is a one-line CheckpointError naming the file: a
malformed manifest or ``latest``, an unlisted file, a DCP storage path that leaves the
directory, a refused pickle; ``read_model_weights`` never returns an incomplete dict."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.training.checkpoint import CheckpointError, read_model_weights, write_model_weights
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.safe_reader import load_metadata

CONFIG = GPTConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16, vocab_size=64
)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture
def weights():
    model = GPT(CONFIG, single_context(CONFIG, select_backend("cpu"), seed=3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def ck(tmp_path, weights):
    """A committed weights-only checkpoint ``<tmp>/ck/step_000003``."""
    return write_model_weights(tmp_path / "ck", weights, CONFIG, step=3)


def refused(path, match: str) -> str:
    """The one-line CheckpointError that ``read_model_weights(path)`` raises (any other
    exception fails the test)."""
    with pytest.raises(CheckpointError, match=match) as caught:
        read_model_weights(path)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def edit_manifest(directory, edit) -> None:
    path = directory / mf.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def reseal(directory) -> None:
    """Checksum the directory's files again, as a forger who rewrites the manifest would."""
    manifest = json.loads((directory / mf.MANIFEST).read_text())
    header = {k: v for k, v in manifest.items() if k not in ("format", "files")}
    mf.write_manifest(directory, header)


def test_a_renamed_key_or_a_wrong_type_in_the_manifest_names_it(ck):
    edit_manifest(ck, lambda m: m.update(kinds=m.pop("kind")))
    assert "kind" in refused(ck, r"step_000003/manifest\.json is malformed")
    edit_manifest(ck, lambda m: m.update(kind=m.pop("kinds"), step="3"))
    assert "step" in refused(ck, r"manifest\.json is malformed")
    edit_manifest(ck, lambda m: m.update(step=3, files={"path": ".metadata"}))
    assert "files" in refused(ck, r"manifest\.json is malformed")


def test_a_manifest_file_path_outside_the_directory_is_refused(ck):
    edit_manifest(ck, lambda m: m["files"][0].update(path="../../etc/passwd"))
    refused(ck, r"manifest\.json: file path '\.\./\.\./etc/passwd' leaves the checkpoint")


def test_a_manifest_step_that_is_not_its_directory_s_is_refused(ck):
    edit_manifest(ck, lambda m: m.update(step=4))
    refused(ck, r"manifest\.json is malformed: step 4 in the directory of step 3")


@pytest.mark.parametrize("content", [b"\xffstep_000003\n", b"../../elsewhere\n", b""])
def test_a_malformed_latest_is_an_error_naming_it(ck, content):
    (ck.parent / "latest").write_bytes(content)
    refused(ck.parent, r"ck/latest is (unreadable or )?corrupted")


def test_an_unlisted_data_file_is_refused(ck):
    shutil.copy(ck / "__0_0.distcp", ck / "__1_0.distcp")
    refused(ck, r"__1_0\.distcp is not listed in .*manifest\.json")


def test_a_model_config_that_the_tensors_do_not_match_is_refused(ck):
    """Today's silent failure: a manifest recording 3 layers over a 2-layer checkpoint
    read 2 layers and returned them as a whole model."""
    edit_manifest(ck, lambda m: m["model_config"].update(num_layers=3))
    refused(ck, r"lacks weights .*: layers\.2\.")
    edit_manifest(ck, lambda m: m["model_config"].update(num_layers=1))
    refused(ck, r"has unexpected weights .*: layers\.1\.")
    edit_manifest(ck, lambda m: m["model_config"].update(num_layers=2, vocab_size=128))
    refused(ck, r"has misshapen weights .*: embed\.tok\.weight")


@pytest.mark.parametrize("where", ["../../x.distcp", "/tmp/x.distcp", "sub/../../x.distcp"])
def test_metadata_storage_paths_that_leave_the_directory_are_refused(ck, where):
    metadata = load_metadata(ck / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = where
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))  # as DCP writes it
    outside = (ck / where).resolve() if not where.startswith("/") else None
    if outside is not None:  # a file there to be read: today it is
        shutil.copy(ck / "__0_0.distcp", outside)
    reseal(ck)
    refused(ck, rf"\.metadata: file path '{where}' leaves the checkpoint directory")


def test_a_refused_pickle_is_one_line_naming_the_file(ck):
    (ck / ".metadata").write_bytes(pickle.dumps(Payload()))
    reseal(ck)
    refused(ck, r"step_000003/\.metadata: refusing to unpickle (posix|os)\.system")


def test_a_tensor_file_that_weights_only_refuses_is_one_line_naming_it(ck, tmp_path):
    torch.save(Payload(), tmp_path / "evil.pt")
    evil = (tmp_path / "evil.pt").read_bytes()
    (ck / "evil.distcp").write_bytes(evil)
    metadata = load_metadata(ck / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path, info.offset, info.length = "evil.distcp", 0, len(evil)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ck)
    refused(ck, r"step_000003/evil\.distcp is unreadable: ")


def test_random_byte_flips_in_the_manifest_never_give_a_wrong_or_incomplete_dict(ck, weights):
    path = ck / mf.MANIFEST
    good = path.read_bytes()
    rng = random.Random(1)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(60):
        raw = bytearray(good)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        try:
            _, back, _ = read_model_weights(ck)
        except CheckpointError as e:
            assert "\n" not in str(e), str(e)
            outcomes["refused"] += 1
            continue
        assert set(back) == set(weights)
        assert all(torch.equal(back[k], v) for k, v in weights.items())
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 0, outcomes


def test_a_forged_trainer_state_is_one_checkpoint_error(tiny, tmp_path):
    """trainer_state.json is checksummed; one rewritten with a matching checksum but a
    missing key is refused naming the file, not a KeyError."""
    import hashlib
    import io
    import json

    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.overrides import validate
    from mtcore.training.trainer import train

    config = tiny(training={"steps": 1, "sample_prompt": None})
    step = train(validate(config), stream=io.StringIO()).checkpoint
    state = step / "trainer_state.json"
    forged = json.loads(state.read_text())
    del forged["step"]
    state.write_text(json.dumps(forged))
    manifest = json.loads((step / "manifest.json").read_text())
    digest = hashlib.sha256(state.read_bytes()).hexdigest()
    for entry in manifest["files"]:
        if entry["path"] == "trainer_state.json":
            entry.update(sha256=digest, bytes=state.stat().st_size)
    (step / "manifest.json").write_text(json.dumps(manifest))
    resumed = {**config, "checkpoint": {"dir": str(tmp_path / "next"), "load": str(step)}}
    with pytest.raises(CheckpointError, match=r"trainer_state\.json is malformed"):
        train(validate(resumed), stream=io.StringIO())
