"""Checkpoint paths as a config gives them: ``checkpoint.dir: ~/runs/ck`` in a YAML file
reaches the trainer unexpanded. Saving must expand ``~`` as resuming does
(``has_checkpoint``, ``resolve_checkpoint``), or a restarted job finds nothing to resume
(its saves went to ``./~/runs/ck``) and starts again from step 0."""

from __future__ import annotations

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.training.checkpoint import Checkpointer, has_checkpoint, resolve_checkpoint
from mtcore.training.engine import Engine

MODEL = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=16
)


def test_save_expands_home_like_resume(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    backend = select_backend("cpu")
    layout = ParallelLayout.build(LayoutSpec(), backend.collective, 0, 1)
    engine = Engine(MODEL, layout, backend, micro_batch_size=1, num_microbatches=1)
    done = Checkpointer(engine).save("~/runs/ck", 1, {})
    assert done == home / "runs" / "ck" / "step_000001"
    assert not (cwd / "~").exists()
    assert has_checkpoint("~/runs/ck") and resolve_checkpoint("~/runs/ck") == done
