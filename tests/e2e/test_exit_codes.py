"""Bad input found inside the ranks ends `mtcore train` with one line from rank 0 and
exit status 2 at any --nproc, and Ctrl-C with one line and 130, never a traceback (real
processes):

* ``checkpoint.load`` of a checkpoint of another architecture;
* ``checkpoint.resume`` with a changed ``training.seed`` (the data sampler refuses it);
* an unknown ``MTCORE_BACKEND``, under `mtcore train` and under plain torchrun;
* SIGINT to the launcher's process group (as a terminal's Ctrl-C) mid-training, the
  launcher started with SIGINT ignored (a script's background job, `mtcore train ... &`):
  the ranks still take it (they are forked from a server that inherited the ignore).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mtcore.cli.launch import failed as _failed
from mtcore.testing.processes import rank_pids


@pytest.fixture(scope="module")
def job(tmp_path_factory, write_code_corpus, run_mtcore) -> tuple[Path, Path]:
    """A tiny job and the checkpoint of its one step (``checkpoint.dir``)."""
    root = tmp_path_factory.mktemp("exit_codes")
    config = {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=32),
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(write_code_corpus(root / "docs", 12, 40))], vocab_size=300,
                     cache_dir=str(root / "cache")),
        "training": dict(steps=1, global_batch_size=4, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": str(root / "ck")},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = run_mtcore("train", path)
    assert out.returncode == 0, out.stdout + out.stderr
    return path, root / "ck"


def _one_error_line(out: subprocess.CompletedProcess, message: str) -> None:
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if "error:" in line]
    assert out.returncode == 2, text
    assert len(errors) == 1 and message in errors[0], text
    assert "Traceback" not in text, text


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_checkpoint_of_another_architecture(job, run_mtcore, tmp_path, nproc):
    path, checkpoint = job
    out = run_mtcore(
        "train", path, "--nproc", nproc, "--checkpoint.load", checkpoint,
        "--checkpoint.dir", tmp_path / "ck", "--model.hidden_size", "64",
    )  # fmt: skip
    _one_error_line(out, "holds a different model than the config's model section")
    assert not (tmp_path / "ck" / "latest").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_resuming_with_another_seed(job, run_mtcore, tmp_path, nproc):
    path, checkpoint = job
    shutil.copytree(checkpoint, tmp_path / "ck")
    out = run_mtcore(
        "train", path, "--nproc", nproc, "--checkpoint.dir", tmp_path / "ck",
        "--checkpoint.resume", "true", "--training.steps", "2", "--training.seed", "7",
    )  # fmt: skip
    _one_error_line(out, "cannot resume the data sampler: saved seed=1234 but this run has seed=7")
    assert not (tmp_path / "ck" / "step_000002").exists()


def test_an_unknown_backend(job, run_mtcore, run_command, tmp_path):
    path, _ = job
    out = run_mtcore(
        "train", path, "--nproc", "2", "--checkpoint.dir", "null", MTCORE_BACKEND="nosuch"
    )
    _one_error_line(out, "unknown backend 'nosuch'")
    # Plain torchrun: the ranks find it. torchrun's own failure report is its business;
    # the ranks say it in one line, without a traceback.
    out = run_command(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "mtcore.train", path, "--checkpoint.dir", "null", MTCORE_BACKEND="nosuch",
    )  # fmt: skip
    text = out.stdout + out.stderr
    errors = [line for line in text.splitlines() if line.startswith("mtcore train: error:")]
    assert len(errors) == 1 and "unknown backend 'nosuch'" in errors[0], text
    assert "exitcode  : 2" in text and "[rank" not in text and "BackendError" not in text, text


def test_ctrl_c_ends_the_job_in_one_line(job, cli_env, mtcore_script):
    path, _ = job
    proc = subprocess.Popen(
        [str(mtcore_script), "train", str(path), "--nproc", "2", "--checkpoint.dir", "null",
         "--training.steps", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as a shell's `&`
    )  # fmt: skip
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("step 3/")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert lines and lines[-1].startswith("step 3/"), "".join(lines)
        ranks = rank_pids(below=proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        for pid in ranks.values():  # neither SIGINT nor SIGTERM ignored (else the agent's kill)
            assert not _ignored(pid) & (1 << signal.SIGINT - 1 | 1 << signal.SIGTERM - 1), pid
        os.killpg(proc.pid, signal.SIGINT)  # the launcher and both ranks, as Ctrl-C does
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, rest
    assert rest.rstrip().splitlines()[-1:] == ["mtcore train: interrupted"], rest
    assert "Traceback" not in rest and "error:" not in rest, rest


def _ignored(pid: int) -> int:
    """The mask of signals ``pid`` ignores (``SigIgn`` in ``/proc/PID/status``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)


def _failures(**codes: int) -> dict:
    return {int(rank[1:]): SimpleNamespace(exitcode=code) for rank, code in codes.items()}


def test_the_launchers_status_for_failed_ranks(capsys):
    assert _failed(_failures(r0=2, r1=2)) == 2  # bad input: the ranks printed it
    assert _failed(_failures(r0=2, r1=-15)) == 2  # rank 1 stopped by the agent
    assert _failed(_failures(r0=-15, r1=2)) == 2
    assert capsys.readouterr().err == ""
    assert _failed(_failures(r0=2, r1=1)) == 1  # a rank failed otherwise
    assert _failed(_failures(r0=-9)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "rank 0 (exit 2), rank 1 (exit 1) failed" in err
