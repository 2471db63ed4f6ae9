"""Ranks never outlive their launcher, and a stuck rank ends the job within the collective
timeout, naming the call and the ranks it waited for (real `mtcore train` processes).

* ``kill -9`` of the `mtcore train` launcher: its ranks are gone within seconds (a
  parent-death signal in each rank), instead of training and checkpointing on;
* ``kill -STOP`` of one rank of ``--nproc 2`` with ``training.collective_timeout_s 5``:
  the job exits non-zero within the timeout and a grace period, and the other rank's
  one-line error names the call ("did not complete within 5 s") and its peer ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mtcore.testing.processes import alive, rank_pids

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs /proc and prctl"
)


@pytest.fixture(scope="module")
def job(tmp_path_factory, write_code_corpus) -> Path:
    root = tmp_path_factory.mktemp("lifetime")
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=32),
        "parallel": {"pp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(write_code_corpus(root / "docs", 12, 40))], vocab_size=300,
                     cache_dir=str(root / "cache")),
        "training": dict(steps=100000, global_batch_size=4, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None, collective_timeout_s=5),
        "checkpoint": {"dir": None},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(job: Path, cli_env, mtcore_script) -> subprocess.Popen:
    return subprocess.Popen(
        [str(mtcore_script), "train", str(job), "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
    )


def _wait_for_training(proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    """Read the launcher's output until rank 0 logs step 2; return the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("step 2/"):
            return lines
    proc.kill()
    pytest.fail("training did not start:\n" + "".join(lines[-30:]))


def test_killing_the_launcher_ends_its_ranks(job, cli_env, mtcore_script):
    proc = _start(job, cli_env, mtcore_script)
    try:
        _wait_for_training(proc)
        ranks = rank_pids(below=proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in ranks.values()):
            time.sleep(0.2)
        assert not [p for p in ranks.values() if alive(p)], "ranks outlived the launcher"
    finally:
        for pid in rank_pids(below=proc.pid).values():
            os.kill(pid, signal.SIGKILL)


# Slow (about 40 s: the 5 s timeout, then torch's agent waits 30 s for the stopped rank to
# take its SIGTERM before it kills it): make test-cluster runs it, in CI too.
@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout(job, cli_env, mtcore_script):
    proc = _start(job, cli_env, mtcore_script)
    stopped = None
    try:
        _wait_for_training(proc)
        ranks = rank_pids(below=proc.pid)
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=90)
        took = time.monotonic() - start
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:]
    assert took < 60, f"the job took {took:.0f} s to end"
    errors = [line for line in out.splitlines() if line.startswith("mtcore train: error: rank 0:")]
    assert errors and "did not complete within 5 s" in errors[0], out[-3000:]
    # the stopped rank by its global rank and host (the mailbox), or the c10d call's peers
    assert "rank(s) 1 (pid" in errors[0] or "rank(s) [1]" in errors[0], errors[0]
