"""A SIGTERM (Slurm's and Kubernetes' preemption signal) saves, and the next run continues.

Real processes, real signals, tp2 on 2 local ranks with dropout (so the RNG streams
matter), ``checkpoint.interval 0`` (no save of its own before the end):

1. SIGTERM to rank 1 alone (tp rank 1: the flag must reach rank 0 through the loss
   reduction): both ranks stop after the same step, commit it, and the job exits 143
   with one line naming the step and the commit;
2. the same command with ``--checkpoint.resume true``, SIGTERM to every process of the
   job this time, the launcher and its rank server included (Slurm signals every process
   of a job step; the launcher passes the signal on too): exit 143 again, a later commit;
3. resumed once more to the end: every loss (full precision, TensorBoard, steps trained
   twice logged twice with the same value) and the final weights equal an uninterrupted
   run's, bit for bit.

And under ``--max-restarts 2``, a SIGTERM to rank 0 or to rank 1 alone ends the job with
143 after the commit: no restart round (which would train on to the end, rc 0).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from mtcore.testing.processes import rank_pids
from mtcore.testing.runs import by_step, tensorboard_scalars, weight_differences

# Long enough that a signal sent when a step's line is read lands well before the end,
# even at 0.01 s a step (a quiet machine): the stop comes a step or two after it.
STEPS = 60
PREEMPTED = re.compile(
    r"mtcore train: preempted: SIGTERM stopped the job after step (\d+): committed (\S+) "
    r"[0-9.]+ s after the signal; the same command continues from it"
)
OTHER_RANK = re.compile(
    r"mtcore train: preempted: a signal to another rank stopped the job after step (\d+): "
    r"committed (\S+); the same command"
)


def _config(tmp_path: Path, corpus: Path, name: str) -> Path:
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=16, dropout=0.1),
        "parallel": {"tp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache")),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=STEPS, global_batch_size=4, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": str(tmp_path / name / "checkpoints"), "interval": 0},
        "logging": dict(interval=1, tensorboard_dir=str(tmp_path / name / "tensorboard"),
                        progress="lines"),
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Run:
    """`mtcore train` in the background, its output collected line by line."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,  # a process group of its own, as a job step's
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for_step(self, step: int, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        mark = re.compile(rf"^step (\d+)/{STEPS} \|")
        while not any((m := mark.match(line)) and int(m.group(1)) >= step for line in self.lines):
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no step {step}:\n{self.text()}"
            time.sleep(0.02)

    def finish(self, timeout_s: float = 240) -> str:
        self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.slow  # make test-cluster (about 25 s)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_sigterm_commits_an_agreed_step_and_the_next_run_continues_exactly(
    tmp_path, write_code_corpus, mtcore_script, cli_env, run_mtcore
):
    corpus = write_code_corpus(tmp_path / "docs", n_docs=10, n_lines=30)
    reference = run_mtcore("train", _config(tmp_path, corpus, "plain"), "--nproc", "2")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = by_step(tensorboard_scalars(tmp_path / "plain" / "tensorboard"))
    assert sorted(expected) == list(range(1, STEPS + 1))

    command = [str(mtcore_script), "train", str(_config(tmp_path, corpus, "cut")), "--nproc", "2"]
    env = cli_env(PYTHONUNBUFFERED="1")
    checkpoints = tmp_path / "cut" / "checkpoints"

    # 1. One rank alone gets the signal.
    first = Run(command, env)
    first.wait_for_step(3)
    os.kill(rank_pids(below=first.process.pid)[1], signal.SIGTERM)
    log = first.finish()
    assert first.process.returncode == 143, log
    stopped = PREEMPTED.search(log) or OTHER_RANK.search(log)
    assert stopped, log
    step = int(stopped.group(1))
    assert 3 <= step < STEPS and stopped.group(2) == str(checkpoints / f"step_{step:06d}")
    assert (checkpoints / "latest").read_text().strip() == f"step_{step:06d}"
    assert "Traceback" not in log, log

    # 2. Every process of the job gets it, the launcher (which passes it on) included.
    second = Run([*command, "--checkpoint.resume", "true"], env)
    second.wait_for_step(step + 2)
    os.killpg(second.process.pid, signal.SIGTERM)
    log = second.finish()
    assert second.process.returncode == 143, log
    assert f"resumed from {checkpoints / f'step_{step:06d}'} at step {step}" in log, log
    again = PREEMPTED.search(log)
    assert again, log
    later = int(again.group(1))
    assert step + 2 <= later < STEPS, log
    assert "mtcore train: stopped by SIGTERM" in log

    # 3. To the end: bit for bit the uninterrupted run.
    third = run_mtcore(*command[1:], "--checkpoint.resume", "true", PYTHONUNBUFFERED="1")
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"at step {later}" in third.stdout
    got = by_step(tensorboard_scalars(tmp_path / "cut" / "tensorboard"))
    assert got == expected
    assert not weight_differences(tmp_path / "plain" / "checkpoints", checkpoints)


@pytest.mark.slow  # make test-cluster (about 30 s)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("target", [0, 1])
def test_sigterm_to_one_rank_under_max_restarts_ends_the_job_with_143(
    tmp_path, write_code_corpus, mtcore_script, cli_env, target
):
    """docs/clusters.md: a SIGTERM to any one rank stops the job with 143, restarts or not
    (the agent would restart ranks that exit 143, and count it). Rank 1: the launcher hears
    of it from local rank 0, which did not get the signal; rank 0: from the rank that did."""
    corpus = write_code_corpus(tmp_path / "docs", n_docs=10, n_lines=30)
    command = [str(mtcore_script), "train", str(_config(tmp_path, corpus, "cut")), "--nproc", "2",
               "--max-restarts", "2"]  # fmt: skip
    run = Run(command, cli_env(PYTHONUNBUFFERED="1"))
    run.wait_for_step(3)
    os.kill(rank_pids(below=run.process.pid)[target], signal.SIGTERM)
    log = run.finish()
    assert run.process.returncode == 143, log
    stopped = PREEMPTED.search(log) or OTHER_RANK.search(log)
    assert stopped, log
    step = int(stopped.group(1))
    assert step < STEPS and f"step {STEPS}/{STEPS}" not in log, log
    assert "restart 1 of at most 2" not in log, log  # no new round: the budget is untouched
    assert "Traceback" not in log, log
    if target == 1:  # the launcher's own line: its ranks stopped on a signal it never got
        assert f"a SIGTERM to another node or rank of this job stopped it after step {step}" in log
    checkpoints = tmp_path / "cut" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{step:06d}"
