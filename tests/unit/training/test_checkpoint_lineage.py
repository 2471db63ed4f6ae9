"""Runs that share a checkpoint.dir never write over each other, and the same command
continues (issue 48 §1-2).

Real `mtcore train` processes on one tiny config (one rank, in the launcher's process):

* a run of another config (a short experiment beside a finished run) is refused in one
  line naming the three ways on, before step 1, and the directory is untouched; the
  same config over its finished run likewise; ``--checkpoint.overwrite true`` trains
  afresh and its first commit removes the earlier run's steps;
* a run stopped by SIGTERM continues when the same command runs again, without
  ``--checkpoint.resume``, and ends with the uninterrupted run's final weights;
* ``latest`` one commit behind (a kill between renaming ``step_N`` and replacing
  ``latest``) still resolves to ``step_N``; ``convert`` and ``generate`` say the step
  they read;
* rank 0's check before a commit refuses to move ``latest`` over another lineage or to
  replace one of its steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
import yaml

from mtcore.testing.runs import weight_differences
from mtcore.training.checkpoint import CheckpointError, read_model_weights, resolve_checkpoint
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.lineage import check_commit, latest_commit

STEPS = 4


def _config(tmp_path, tiny, name: str, steps: int = STEPS) -> str:
    config = tiny(
        training=dict(steps=steps, sample_tokens=0, eval_interval=0),
        checkpoint=dict(interval=1, dir=str(tmp_path / name / "checkpoints")),
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _state(root) -> dict[str, bytes]:
    """Every file under ``root``, by relative path: to show a refused run changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.extended  # four `mtcore train`-sized processes: 20-30 s
def test_a_run_over_another_runs_checkpoints_is_refused_or_overwrites_when_asked(
    tmp_path, tiny, run_mtcore
):
    config = _config(tmp_path, tiny, "run")
    root = tmp_path / "run" / "checkpoints"
    first = run_mtcore("train", config)
    assert first.returncode == 0, first.stdout + first.stderr
    before = _state(root)

    # A short experiment of another config (issue 48 §2: it moved latest back to its step).
    other = run_mtcore("train", config, "--training.steps", "2", "--optimizer.lr", "0.02")
    assert other.returncode == 2, other.stdout + other.stderr
    assert other.stderr.strip() == (
        f"mtcore train: error: checkpoint.dir {root} holds another run's checkpoints (latest "
        "step 4, written by another config or a run that started afresh); this run would "
        "start at step 1 over them. Continue that run with --checkpoint.resume true, give "
        "this one its own directory (--checkpoint.dir or --logging.run_name), or replace "
        "them with --checkpoint.overwrite true"
    )
    assert "step 1/" not in other.stdout
    # The same config again, over its finished run.
    again = run_mtcore("train", config)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"checkpoint.dir {root} holds this config's finished run (step 4 of 4)" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert _state(root) == before

    fresh = run_mtcore("train", config, "--training.steps", "2", "--checkpoint.overwrite", "true")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert (
        "checkpoint: removed the earlier run's steps 2-4 (--checkpoint.overwrite)" in fresh.stdout
    )
    assert [step for step, _ in mf.committed_steps(root)] == [1, 2]
    assert (root / mf.LATEST).read_text().strip() == mf.step_dir_name(2)


@pytest.mark.extended  # four `mtcore train`-sized processes: 20-30 s
def test_the_same_command_continues_a_run_stopped_by_sigterm(tmp_path, tiny, run_mtcore,
                                                             mtcore_script, cli_env):  # fmt: skip
    plain = run_mtcore("train", _config(tmp_path, tiny, "plain", 40))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    config = _config(tmp_path, tiny, "cut", 40)
    root = tmp_path / "cut" / "checkpoints"
    command = [str(mtcore_script), "train", config]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=cli_env(PYTHONUNBUFFERED="1"))  # fmt: skip
    for line in job.stdout:
        if (logged := re.match(r"step (\d+)/40 ", line)) and int(logged.group(1)) >= 2:
            job.send_signal(signal.SIGTERM)
            break
    out = line + job.stdout.read()
    assert job.wait(timeout=120) == 143, out
    step = mf.read_manifest(resolve_checkpoint(root))["step"]
    assert 2 <= step < 40, out

    again = run_mtcore("train", config)  # the very same command: no --checkpoint.resume
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        f"checkpoint: the latest commit (step {step} of 40) is an unfinished run of this same "
        "config: resuming it" in again.stdout
    ), again.stdout
    assert f"resumed from {root / mf.step_dir_name(step)} at step {step}" in again.stdout
    assert not weight_differences(tmp_path / "plain" / "checkpoints", root)


@pytest.mark.extended  # four `mtcore train`-sized processes: 20-30 s
def test_latest_one_commit_behind_resolves_to_the_commit_and_readers_say_the_step(
    tmp_path, tiny, run_mtcore
):
    config = _config(tmp_path, tiny, "run")
    root = tmp_path / "run" / "checkpoints"
    assert run_mtcore("train", config).returncode == 0
    # The disk as a kill -9 between renaming step_000004 into place and replacing latest
    # leaves it (commit(): the manifest, the rename, then latest.tmp and os.replace).
    (root / mf.LATEST).write_text(mf.step_dir_name(3) + "\n")
    (root / (mf.LATEST + ".tmp")).write_text(mf.step_dir_name(4) + "\n")
    assert resolve_checkpoint(root) == root / mf.step_dir_name(4)
    assert read_model_weights(root)[2] == 4

    exported = run_mtcore("convert", "to-hf", root, tmp_path / "hf")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    said = f"mtcore convert to-hf: read step 4: {root / mf.step_dir_name(4)} (the latest commit under {root})"
    assert said in exported.stderr, exported.stderr
    sampled = run_mtcore(
        "generate", root / mf.step_dir_name(2), "--prompt", "def", "--max-new-tokens", "2"
    )
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr
    assert f"mtcore generate: read step 2: {root / mf.step_dir_name(2)}\n" in sampled.stderr
    # The same command resumes the commit, not the step latest names: nothing to train.
    resumed = run_mtcore("train", config, "--checkpoint.resume", "true")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "nothing to train: the checkpoint is at step 4" in resumed.stdout


def test_a_commit_never_moves_latest_over_another_lineage_or_replaces_its_step(
    tmp_path, tiny, run_mtcore
):
    config = _config(tmp_path, tiny, "run")
    root = tmp_path / "run" / "checkpoints"
    assert run_mtcore("train", config).returncode == 0
    ours = latest_commit(root)["lineage"]
    check_commit(root, 5, ours, overwrite=False)  # the run's own next step: fine
    stranger = {"id": "0123456789ab", "config": None}
    with pytest.raises(CheckpointError) as refused:
        check_commit(root, 2, stranger, overwrite=False)
    assert str(refused.value) == (
        f"not committing step 2 into checkpoint.dir {root}: its latest commit, step 4 and its "
        "step 2 belong to another run; give this run its own --checkpoint.dir (or "
        "--logging.run_name), or pass --checkpoint.overwrite true to replace them"
    )
    check_commit(root, 2, stranger, overwrite=True)
    # A later commit of another lineage never counts as ours when latest lags behind.
    (root / mf.LATEST).write_text(mf.step_dir_name(3) + "\n")
    manifest = mf.read_manifest(root / mf.step_dir_name(4))
    manifest["lineage"] = stranger
    (root / mf.step_dir_name(4) / mf.MANIFEST).write_text(json.dumps(manifest))
    assert resolve_checkpoint(root) == root / mf.step_dir_name(3)


def test_how_a_run_starts_on_a_directory_holding_a_commit(tmp_path):
    """``lineage.decide`` on every case (the default suite's share; the processes above
    run in make test-extended): none, resume, the same elastic run, an imported model,
    the same config unfinished and finished, overwrite, another run."""
    from mtcore.training.checkpoint.lineage import decide, fingerprint
    from mtcore.training.config import TrainConfig

    def config(**checkpoint):
        return TrainConfig.model_validate(
            {"training": {"steps": 10}, "checkpoint": {"dir": str(tmp_path), **checkpoint}}
        )

    plain, mine = config(), fingerprint(config())
    assert mine == fingerprint(config(resume=True)) == fingerprint(config(overwrite=True))
    assert mine != fingerprint(config(interval=5))
    logged = TrainConfig.model_validate(
        {"training": {"steps": 10}, "checkpoint": {"dir": str(tmp_path)}, "logging": {"interval": 1}}
    )
    assert fingerprint(logged) == mine  # how a run reports is not what it trains
    theirs = {"id": "aaaaaaaaaaaa", "config": "f" * 64}
    latest = {"step": 4, "run_id": "job-1", "kind": "training", "lineage": theirs}
    assert decide(plain, None, None, mine).resume is False
    assert decide(config(resume=True), latest, None, mine)[:2] == (True, theirs)
    assert decide(plain, latest, "job-1", mine)[:2] == (True, theirs)  # a restart, a requeue
    assert decide(plain, {**latest, "kind": "weights"}, None, mine).resume is False
    same = {**latest, "lineage": {"id": "bbbbbbbbbbbb", "config": mine}}
    assert decide(plain, same, None, mine).resume is True
    with pytest.raises(CheckpointError, match=r"holds this config's finished run \(step 10 of 10\)"):
        decide(plain, {**same, "step": 10}, None, mine)
    afresh = decide(config(overwrite=True), latest, None, mine)
    assert afresh.resume is False and afresh.lineage["id"] != theirs["id"]
    assert afresh.lineage["config"] == mine
    with pytest.raises(CheckpointError, match="holds another run's checkpoints"):
        decide(plain, latest, None, mine)
