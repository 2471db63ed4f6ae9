"""A full disk during a save is one line naming the step and the last complete checkpoint.

It was ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704
vs 598`` (or DCP's ``CheckpointException``) with a traceback per rank. The incomplete
save is removed and the committed checkpoints stay loadable."""

from __future__ import annotations

import errno
import shutil
import subprocess

import pytest
import yaml

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.training.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    read_model_weights,
    resolve_checkpoint,
)
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.checkpointer import disk_full
from mtcore.training.engine import Engine

# One checkpoint of the tiny job (tests/unit/training/conftest.py) takes about 800 KiB:
# the first fits on this disk, the second does not.
DISK_SIZE = "1200k"
FULL = "no space left on device while saving step 2 to {}; step 1 is the last complete checkpoint"


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of DISK_SIZE (root only; skipped where it cannot be mounted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(disk)]
    result = subprocess.run(mount, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("extra", [[], ["--checkpoint.async_save", "true"]], ids=["sync", "async"])
def test_second_checkpoint_does_not_fit(tmp_path, tiny, run_mtcore, small_disk, extra):
    config = tiny(training=dict(steps=2, sample_tokens=0), checkpoint=dict(interval=1))
    config["checkpoint"]["dir"] = str(small_disk)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_mtcore("train", path, *extra)
    assert result.returncode == 1, result.stderr  # training ran; a save failed
    # the data progress lines come first when the tokenizer cache is cold (run alone)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"mtcore train: error: {FULL.format(small_disk)}"], result.stderr
    assert result.stderr.endswith(f"{FULL.format(small_disk)}\n")
    assert sorted(p.name for p in small_disk.iterdir()) == ["latest", "step_000001"]
    _, weights, step = read_model_weights(small_disk)
    assert step == 1 and weights


MODEL = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=16
)


@pytest.mark.parametrize("victim", ["write_json_atomic", "write_manifest"])
def test_full_disk_writing_trainer_state_or_manifest(tmp_path, monkeypatch, victim):
    backend = select_backend("cpu")
    layout = ParallelLayout.build(LayoutSpec(), backend.collective, 0, 1)
    engine = Engine(MODEL, layout, backend, micro_batch_size=1, num_microbatches=1)
    checkpointer = Checkpointer(engine)
    first = checkpointer.save(tmp_path, 1, {})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mf, victim, full)
    with pytest.raises(CheckpointWriteError) as err:
        checkpointer.save(tmp_path, 2, {})
    assert str(err.value) == FULL.format(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert resolve_checkpoint(tmp_path) == first


def test_disk_full_is_recognised_through_wrappers_only_for_a_full_disk():
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = short_write
    assert disk_full(wrapped) == "no space left on device"
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) == "disk quota exceeded"
    assert disk_full(PermissionError(errno.EACCES, "Permission denied")) is None
    assert disk_full(ValueError("bad shape")) is None
