"""One writer per checkpoint directory, and output directories checked before step 1.

Two ``mtcore train`` jobs on one ``checkpoint.dir`` replaced each other's steps
silently; an unwritable directory failed only at the first save (or inside the data
layer) with a traceback. Real processes here, as a user starts them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from mtcore.training.checkpoint import CheckpointError
from mtcore.training.checkpoint import owner as owner_lock
from tests.unit.training.conftest import tiny_config

SHORT = dict(training=dict(steps=2, sample_tokens=0), checkpoint=dict(interval=1))


def _job(tmp_path, tiny, name="job", **sections) -> str:
    config = tiny(**{**SHORT, **sections})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_two_jobs_on_one_directory_one_trains_the_other_is_refused(
    tmp_path, tiny, cli_env, mtcore_script
):
    root = tmp_path / "checkpoints"
    config = _job(tmp_path, tiny)
    # Each job holds the directory for at least 2 x 3 s of commits, so they overlap.
    env = cli_env(MTCORE_CHECKPOINT_COMMIT_DELAY_S="3")
    jobs = [
        subprocess.Popen(
            [str(mtcore_script), "train", config, "--training.seed", str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for seed in (1, 2)
    ]  # fmt: skip
    streams = [job.communicate(timeout=300) for job in jobs]
    outs = [
        (job.pid, job.returncode, out, err) for job, (out, err) in zip(jobs, streams, strict=True)
    ]
    codes = sorted(code for _, code, _, _ in outs)
    assert codes == [0, 2], outs
    (winner, _, won_out, _), (_, _, lost_out, lost_err) = sorted(outs, key=lambda o: o[1])
    assert "step 2/2" in won_out
    assert "step 1" not in lost_out + lost_err
    # One line says it; before it, the loser may have prepared the shared data cache
    # (its progress lines), had it started first.
    lines = [line for line in lost_err.splitlines() if line.startswith("mtcore train")]
    assert len(lines) == 1 and "Traceback" not in lost_err, lost_err
    assert f"in use by pid {winner} on host {socket.gethostname()}" in lines[0]
    assert str(root) in lines[0]
    assert (root / "latest").read_text().strip().endswith("step_000002")
    assert not (root / owner_lock.LOCK_FILE).exists()  # released at the end


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, tiny, run_mtcore):
    root = tmp_path / "checkpoints"
    root.mkdir()
    dead = _dead_pid()
    stale = {"host": socket.gethostname(), "pid": dead, "started": "2020-01-01T00:00:00+00:00"}
    (root / owner_lock.LOCK_FILE).write_text(json.dumps(stale))
    run = run_mtcore("train", _job(tmp_path, tiny))
    assert run.returncode == 0, run.stderr
    assert f"taking over the stale lock {root / owner_lock.LOCK_FILE}: pid {dead}" in run.stdout
    assert "step 2/2" in run.stdout
    assert not (root / owner_lock.LOCK_FILE).exists()


def test_a_lock_from_another_host_is_live_until_its_heartbeat_is_old(tmp_path):
    """Where the file system only enforces locks on one host, the record decides."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    path = root / owner_lock.LOCK_FILE
    path.write_text(json.dumps({"host": "elsewhere", "pid": 4242, "started": "now"}))
    with pytest.raises(CheckpointError, match="in use by pid 4242 on host elsewhere"):
        owner_lock.acquire(root)
    old = time.time() - owner_lock.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    lock = owner_lock.acquire(root)
    try:
        assert "stale lock" in lock.notice and "pid 4242 on host elsewhere" in lock.notice
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match=f"in use by pid {os.getpid()}"):
            owner_lock.acquire(root)  # a second open file: flock refuses it, even here
    finally:
        lock.release()
    assert not path.exists()


UNWRITABLE = ["checkpoint.dir", "logging.tensorboard_dir", "data.cache_dir", "cache_file"]


@pytest.fixture(scope="module")
def unwritable_runs(tmp_path_factory, corpus, data_cache, run_mtcore) -> dict:
    """Per case: (the key, the unwritable path, the run), the four jobs side by side
    (each is mostly an interpreter's start-up). Root ignores permission bits: a path
    under a regular file is unwritable to anyone."""
    from concurrent.futures import ThreadPoolExecutor

    def start(case: str):
        root = tmp_path_factory.mktemp(case)
        blocker = root / "a_file"
        blocker.write_text("not a directory")
        bad = blocker if case == "cache_file" else blocker / "sub"
        key = "data.cache_dir" if case == "cache_file" else case
        job = root / "job.yaml"
        config = tiny_config(corpus, data_cache, root, **SHORT)
        job.write_text(yaml.safe_dump(config))
        return key, bad, run_mtcore("train", str(job), f"--{key}", bad)

    with ThreadPoolExecutor(max_workers=len(UNWRITABLE)) as pool:
        return dict(zip(UNWRITABLE, pool.map(start, UNWRITABLE), strict=True))


@pytest.mark.parametrize("case", UNWRITABLE)
def test_an_unwritable_directory_is_refused_before_step_1(unwritable_runs, case):
    key, bad, run = unwritable_runs[case]
    assert run.returncode == 2, run.stdout + run.stderr
    assert "step 1" not in run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert f"{key} {bad}" in run.stderr


def test_a_read_only_mount_is_refused_although_root_passes_os_access(tmp_path):
    """The probe file, not ``os.access``: root is granted W_OK on a read-only mount."""
    from mtcore.training.config import ConfigError
    from mtcore.training.writable import check_writable

    mount = tmp_path / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.decode().strip()}")
    try:
        with pytest.raises(
            ConfigError, match=r"checkpoint.dir .*/ro/ck is not writable \(creating"
        ):
            check_writable("checkpoint.dir", mount / "ck")
        with pytest.raises(ConfigError, match=r"is not writable: Read-only file system"):
            check_writable("logging.tensorboard_dir", mount)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    check_writable("checkpoint.dir", mount / "ck")  # the plain directory under it is fine
    assert list(mount.iterdir()) == []  # the probe left nothing behind


_EARLIER_INCARNATION = """
import sys
from mtcore.backend import select_backend
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.models.gpt import GPTConfig
from mtcore.training.checkpoint import CheckpointError, Checkpointer
from mtcore.training.checkpoint import owner
from mtcore.training.engine import Engine

root = sys.argv[1]
model = GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=16)
backend = select_backend("cpu")
engine = Engine(model, ParallelLayout.build(LayoutSpec(), backend.collective, 0, 1), backend,
                micro_batch_size=1, num_microbatches=1)
lock = owner.acquire(root, run_id="job-7")
ours = owner.Ownership(lock.record["incarnation"], lock)
checkpointer = Checkpointer(engine, owner=ours, run_id="job-7")
print("saved", checkpointer.save(root, 1, {}).name, flush=True)
sys.stdin.readline()  # meanwhile the job moved on without this process
try:
    checkpointer.save(root, 2, {})
    print("committed step 2", flush=True)
except CheckpointError as e:
    print("refused:", e, flush=True)
"""


def test_an_earlier_incarnation_left_running_is_taken_over_and_commits_nothing(tmp_path, cli_env):
    """A rank 0 on a node cut off from the job lives on: the restarted job (same run id) waits
    for it a while, then takes the directory over, and the old one can no longer commit."""
    root = tmp_path / "checkpoints"
    earlier = subprocess.Popen(
        [sys.executable, "-c", _EARLIER_INCARNATION, str(root)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
    )  # fmt: skip
    try:
        assert earlier.stdout.readline().strip() == "saved step_000001", earlier.stderr.read()
        with pytest.raises(CheckpointError, match=f"in use by pid {earlier.pid}"):
            owner_lock.acquire(root, run_id="another-job", wait_s=5)  # refused at once
        said: list[str] = []
        started = time.monotonic()
        lock = owner_lock.acquire(root, run_id="job-7", wait_s=0.5, say=said.append)
        waited = time.monotonic() - started
        try:
            assert 0.5 <= waited < 5, waited
            assert len(said) == 2, said
            assert said[0].startswith("checkpoint: waiting up to 0.5 s for an earlier incarnation")
            assert (
                f"taking over {root / owner_lock.LOCK_FILE} from an earlier incarnation" in said[1]
            )
            assert lock.fence() is None
            earlier.stdin.write("go\n")
            earlier.stdin.flush()
            out, err = earlier.communicate(timeout=60)
        finally:
            lock.release()
    finally:
        if earlier.poll() is None:
            earlier.kill()
    assert out.startswith("refused: not committing step 2: checkpoint.dir"), out + err
    assert f"now belongs to pid {os.getpid()}" in out
    assert (root / "latest").read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()
