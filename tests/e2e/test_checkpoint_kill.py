"""Kill a rank in the middle of a save, then resume: a real job, a real SIGKILL.

`mtcore train --nproc 2` (pp=2) saves every 2 steps. Rank 0 is made to pause
between writing a save and committing it (MTCORE_CHECKPOINT_COMMIT_DELAY_S), the
test waits until the save of step 4 is fully written into its ``.partial``
directory but not committed, and SIGKILLs rank 0; the launcher then stops the
other rank. The previous checkpoint (step 2) must still be the latest and load,
and a restarted job (``checkpoint.resume``) must report the partial save, resume
from step 2 and retrace the killed run's losses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from mtcore.testing.processes import rank_pids

LOSS = re.compile(r"^step (\d+)/\d+ \| loss ([0-9.]+)", re.MULTILINE)


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


@pytest.mark.slow  # make test-cluster (about 20 s)
def test_kill_mid_save_then_resume_from_the_previous_checkpoint(
    tmp_path, write_code_corpus, mtcore_script, cli_env, run_command
):
    ckpt = tmp_path / "checkpoints"
    corpus = write_code_corpus(tmp_path / "docs", n_docs=10, n_lines=30)
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=16),
        "parallel": {"pp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=6, global_batch_size=4, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": str(ckpt), "interval": 2, "resume": True},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [str(mtcore_script), "train", str(path), "--nproc", "2"]

    env = cli_env(PYTHONUNBUFFERED="1", MTCORE_CHECKPOINT_COMMIT_DELAY_S="8")
    first = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    deadline = time.monotonic() + 240
    # The save's staging directory: step_000004.<the job's incarnation>.partial.
    while not (
        (ckpt / "step_000002" / "manifest.json").is_file()
        and (partial := next(ckpt.glob("step_000004.*partial/.metadata"), None)) is not None
    ):
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "the job never reached the save of step 4"
        time.sleep(0.05)
    partial = partial.parent
    rank0 = rank_pids(below=first.pid).get(0)
    assert rank0 is not None
    os.kill(rank0, signal.SIGKILL)
    killed_log, _ = first.communicate(timeout=120)
    assert first.returncode != 0, killed_log

    assert partial.is_dir() and not (ckpt / "step_000004").exists()
    assert (ckpt / "latest").read_text().strip() == "step_000002"

    second = run_command(*command, PYTHONUNBUFFERED="1")
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    assert f"ignoring incomplete checkpoint {partial}" in log
    assert f"resumed from {ckpt / 'step_000002'} at step 2" in log
    assert (ckpt / "latest").read_text().strip() == "step_000006" and not partial.exists()
    before, after = _losses(killed_log), _losses(second.stdout)
    assert sorted(after) == [3, 4, 5, 6]
    assert {s: before[s] for s in (3, 4)} == {s: after[s] for s in (3, 4)}
