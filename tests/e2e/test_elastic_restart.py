"""`mtcore train --max-restarts N`: torch's elastic agent restarts all ranks when one dies,
and they resume from the last committed checkpoint (real processes, a real SIGKILL).

* ``--nproc 4 --max-restarts 1`` (tp2 x pp2), a checkpoint every step, dropout 0.1: SIGKILL one rank
  (chosen at random, as is the step) once a step is committed. The job exits 0, its log
  shows the restart and a resume from a committed step, every step after it is trained
  once, and the final weights (and every logged loss) equal an uninterrupted run's bit
  for bit: the data position and the RNG streams come back from the checkpoint.
* ``--max-restarts 1`` without a ``checkpoint.dir`` is refused with one line (exit 2).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mtcore.testing.processes import rank_pids

STEPS = 6
LOSS = re.compile(r"^step (\d+)/\d+ \| loss ([0-9.]+)", re.MULTILINE)
RESUMED = re.compile(r"checkpoint: resumed from (\S+) at step (\d+)")


def _config(tmp_path: Path, corpus: Path, ckpt: Path | None) -> Path:
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=16, dropout=0.1),
        "parallel": {"tp": 2, "pp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=STEPS, global_batch_size=4, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": str(ckpt) if ckpt else None, "interval": 1},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip
    path = tmp_path / f"job_{ckpt.name if ckpt else 'none'}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(text)}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_killed_rank_restarts_the_job_which_resumes_exactly(
    tmp_path, write_code_corpus, mtcore_script, cli_env, run_command
):
    from mtcore.training.checkpoint import read_model_weights

    corpus = write_code_corpus(tmp_path / "docs", n_docs=10, n_lines=30)
    plain, elastic = tmp_path / "plain", tmp_path / "elastic"
    reference = run_command(
        mtcore_script, "train", _config(tmp_path, corpus, plain), "--nproc", "4",
        PYTHONUNBUFFERED="1",
    )  # fmt: skip
    assert reference.returncode == 0, reference.stdout + reference.stderr

    rng = random.Random()
    after, victim = rng.randint(1, STEPS - 2), rng.randint(0, 3)
    what = f"rank {victim} killed after step {after} was committed"
    command = [str(mtcore_script), "train", str(_config(tmp_path, corpus, elastic))]
    command += ["--nproc", "4", "--max-restarts", "1"]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=cli_env(PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (elastic / f"step_{after:06d}" / "manifest.json").is_file():
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, f"the job never committed step {after}"
            time.sleep(0.02)
        pid = rank_pids(below=job.pid).get(victim)
        assert pid is not None, what
        os.kill(pid, signal.SIGKILL)
        log, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, f"{what}:\n{log[-4000:]}"

    # The agent restarted the ranks once; they resumed from a committed step, not step 0.
    restart = "mtcore train: restart 1 of at most 1 (a rank stopped or a node was lost): resuming from"
    assert log.count(restart) == 1, f"{what}:\n{log[-4000:]}"
    if victim == 0:  # the restarted rank 0 takes over the dead one's checkpoint.dir lock
        assert "checkpoint: taking over the stale lock" in log, log[-4000:]
    resumed = RESUMED.findall(log)
    assert len(resumed) == 1, f"{what}:\n{log[-4000:]}"
    directory, step = resumed[0][0], int(resumed[0][1])
    assert after <= step < STEPS and directory == str(elastic / f"step_{step:06d}"), what
    # Nothing after that commit is counted twice: the restarted ranks train steps
    # step+1 .. STEPS once each, and the job's summary says where it resumed.
    restarted = log[log.index("checkpoint: resumed from") :]
    assert sorted(_losses(restarted)) == list(range(step + 1, STEPS + 1)), what
    assert f"resumed at {step})" in restarted, restarted[-2000:]
    assert (elastic / "latest").read_text().strip() == f"step_{STEPS:06d}"

    # Bit for bit an uninterrupted run: every loss logged, and the final weights.
    expected = _losses(reference.stdout)
    for attempt in (log[: log.index("checkpoint: resumed from")], restarted):
        assert {s: expected[s] for s in _losses(attempt)} == _losses(attempt), what
    _, want, want_step = read_model_weights(plain)
    _, got, got_step = read_model_weights(elastic)
    assert got_step == want_step == STEPS
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].equal(tensor), f"{name}: {what}"


def test_max_restarts_without_a_checkpoint_dir_is_refused(tmp_path, run_mtcore):
    job = _config(tmp_path, tmp_path / "unused", None)
    out = run_mtcore("train", job, "--nproc", "2", "--max-restarts", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "mtcore train: error: --max-restarts needs a checkpoint.dir to resume from"
    ]


def test_max_restarts_needs_a_count(run_mtcore):
    out = run_mtcore("train", "--max-restarts", "x")
    assert out.returncode == 2
    assert "--max-restarts needs a non-negative number, got 'x'" in out.stderr


def test_bad_input_found_in_the_ranks_is_not_retried(tmp_path, write_code_corpus, run_mtcore):
    """A damaged checkpoint is found by the ranks (its checksums), not by the launcher:
    every restart would find it again, so the job stops at once with exit 2 and one line."""
    corpus = write_code_corpus(tmp_path / "docs", n_docs=6, n_lines=20)
    checkpoints = tmp_path / "elastic"
    job = _config(tmp_path, corpus, checkpoints)
    first = run_mtcore("train", job, "--nproc", "2", "--parallel.pp", "1", "--training.steps", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    shard = next((checkpoints / "step_000001").glob("__1_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = run_mtcore("train", job, "--nproc", "2", "--parallel.pp", "1", "--max-restarts", "3",
                     "--checkpoint.resume", "true")  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "restart 1 of at most 3" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mtcore train: error:")]
    assert errors and errors[0].startswith("mtcore train: error: checkpoint file"), out.stderr
    assert "is corrupted" in errors[0] and "Traceback" not in out.stderr
