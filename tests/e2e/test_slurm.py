"""examples/slurm/train.sbatch, submitted unchanged to a real Slurm with two nodes.

The cluster (``mtcore.testing.slurm``): slurmctld and munge on node0, one slurmd
per namespace node, CPUs only. The job is the default one (tp2 inside a node, pp2
across the two nodes, two ranks per node) for a short run that commits every
step, set through the script's variables and ``sbatch --gpus-per-node=0`` only.
It is stopped twice, once each way Slurm stops a job:

* ``scontrol requeue`` (what a preemption does): Slurm SIGTERMs the job's
  processes, the ranks commit an agreed step and exit, and the requeued job
  (the same job id, so the same rendezvous id) resumes that commit by itself;
* ``scancel --signal=TERM``: the signal ``#SBATCH --signal=TERM@180`` sends to the
  job steps before the time limit; the script sees `mtcore train` exit 143 and
  requeues the job itself.

Every loss (TensorBoard, full precision) and the final weights equal an
uninterrupted run of the same layout on one host, bit for bit. Prints the time
from each stop to the first step after it (Slurm's share: until the job runs
again).

Needs root and Slurm (Debian: slurmctld slurmd slurm-client munge); skipped with
the reason otherwise.
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

from mtcore.testing import slurm
from mtcore.testing.runs import by_step, short_run, tensorboard_scalars, weight_differences
from mtcore.training.checkpoint import manifest as mf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
DEFAULT_JOB = ROOT / "configs" / "default.yaml"
STEPS = 20
HEADER = re.compile(r"^train\.sbatch: job \d+ \(restart (\d+)\)", re.MULTILINE)
STEP = re.compile(r"^step (\d+)/", re.MULTILINE)


@pytest.fixture(scope="module")
def cluster():
    reason = slurm.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with slurm.SlurmCluster(2) as made:
        yield made


class Job:
    """The submitted job: its state, its log split into its runs (one per start)."""

    def __init__(self, cluster, job_id: str, directory: Path):
        self.cluster, self.id = cluster, job_id
        self.log = directory / f"mtcore-{job_id}.out"  # the script's --output=%x-%j.out
        self.checkpoints = directory / "runs" / f"mtcore-{job_id}" / "checkpoints"

    def state(self) -> str:
        return self.cluster.job(self.id)["JobState"]

    def runs(self) -> list[str]:
        """The log of each start of the job (the script's first line begins each)."""
        text = self.log.read_text() if self.log.is_file() else ""
        return [run for run in re.split(r"(?m)^(?=train\.sbatch: job )", text) if run]

    def wait(self, ready, what: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()  # before ready(): a job that ends meanwhile is ready, not lost
            if ready():
                return
            assert state in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"), (
                f"job {self.id} is {state} while waiting for {what}:\n{self.text()}"
            )
            assert time.monotonic() < deadline, f"no {what} in {timeout_s} s:\n{self.text()}"
            time.sleep(0.1)

    def committed(self, step: int) -> bool:
        return (self.checkpoints / mf.step_dir_name(step) / mf.MANIFEST).is_file()

    def stop_and_time(self, stop: list[str], run: int) -> tuple[float, float]:
        """Run the Slurm command ``stop``; seconds until the job runs again, and until
        its run number ``run`` logs a step."""
        done = self.cluster.command(*stop, self.id)
        assert done.returncode == 0, done.stderr
        stopped = time.monotonic()
        self.wait(lambda: self.state() != "RUNNING", f"the job leaving RUNNING after {stop}")
        self.wait(lambda: self.state() == "RUNNING", f"the job running again after {stop}")
        running = time.monotonic()
        self.wait(lambda: len(self.runs()) > run and STEP.search(self.runs()[run]), "a step")
        return running - stopped, time.monotonic() - stopped

    def text(self) -> str:
        log = self.log.read_text()[-6000:] if self.log.is_file() else "(no log yet)"
        return f"{log}\n{self.cluster.logs()}"


def _stopped_and_resumed(before: str, after: str, job_id: str) -> int:
    """The step the ranks committed on the SIGTERM in ``before``, checked to be the one
    the next run (``after``) resumed."""
    preempted = re.search(r"preempted: SIGTERM stopped the job after step (\d+): committed", before)
    assert preempted, before
    step = int(preempted.group(1))
    assert f"the latest commit (step {step}) is this run's ({job_id}): resuming it" in after, after
    assert re.search(rf"checkpoint: resumed from \S+ at step {step} ", after), after
    assert [int(s) for s in STEP.findall(after)][:1] == [step + 1], after
    return step


def test_the_sbatch_example_survives_a_requeue_and_a_time_limit_signal_bitwise(
    cluster, tmp_path, run_mtcore, mtcore_script, cli_env
):
    cache = tmp_path / "cache"
    one_host = tmp_path / "one_host"
    out = run_mtcore(
        "train", DEFAULT_JOB, "--nproc", "4", *short_run(one_host, cache, STEPS),
        "--checkpoint.dir", one_host / "checkpoints", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    expected = by_step(tensorboard_scalars(one_host / "tensorboard"))
    assert sorted(expected) == list(range(1, STEPS + 1))

    submitted = tmp_path / "slurm"
    submitted.mkdir()
    env = cli_env(
        PATH=f"{mtcore_script.parent}:{os.environ['PATH']}",  # mtcore, as an activated venv
        PYTHONUNBUFFERED="1",
        MTCORE_CONFIG=str(DEFAULT_JOB),
        MTCORE_NPROC_PER_NODE="2",
        MTCORE_ARGS=" ".join(short_run(submitted, cache, STEPS)),
    )
    sbatch = ["sbatch", "--parsable", "--gpus-per-node=0", SCRIPT]
    done = cluster.command(*sbatch, env=env, cwd=submitted)
    assert done.returncode == 0, done.stderr + cluster.logs()
    job = Job(cluster, done.stdout.strip().split(";")[0], submitted)

    first = random.randint(2, 5)
    job.wait(lambda: job.committed(first), f"the commit of step {first}")
    assert job.state() == "RUNNING"
    requeue = job.stop_and_time(["scontrol", "requeue"], run=1)
    resumed = int(STEP.findall(job.runs()[1])[0]) - 1
    second = resumed + random.randint(2, 4)
    job.wait(lambda: job.committed(second), f"the commit of step {second}")
    signal = job.stop_and_time(["scancel", "--signal=TERM"], run=2)
    job.wait(lambda: job.state() == "COMPLETED", "the job's end")
    fields = cluster.job(job.id)
    assert (fields["ExitCode"], fields["Restarts"]) == ("0:0", "2"), fields

    runs = job.runs()
    assert [HEADER.match(run).group(1) for run in runs] == ["0", "1", "2"], job.text()
    # The requeue SIGTERMs the script too (it ends there); only the signal to the steps
    # leaves it alive to requeue the job itself.
    requeued_itself = f"train.sbatch: stopped after a commit; requeueing job {job.id}"
    assert [requeued_itself in run for run in runs] == [False, True, False], job.text()
    after_requeue = _stopped_and_resumed(runs[0], runs[1], job.id)
    after_signal = _stopped_and_resumed(runs[1], runs[2], job.id)
    assert after_requeue >= first and after_signal >= second, job.text()
    ended = f"done: {STEPS - after_signal} steps (steps {after_signal + 1}-{STEPS}, resumed at"
    assert ended in runs[2], runs[2]

    got = by_step(tensorboard_scalars(submitted / "tensorboard"))
    assert got == expected, job.text()
    differ = weight_differences(one_host / "checkpoints", job.checkpoints)
    assert not differ, f"final weights differ from one host's: {differ[:5]}"
    print(
        f"scontrol requeue after step {first} (committed {after_requeue}): running again "
        f"{requeue[0]:.1f} s later, first step {requeue[1]:.1f} s after the requeue; "
        f"scancel --signal=TERM after step {second} (committed {after_signal}): running again "
        f"{signal[0]:.1f} s later, first step {signal[1]:.1f} s after the signal"
    )


def _launcher_on(node) -> int:
    """The pid of `mtcore train`'s launcher on ``node`` (not its rank server or ranks)."""
    for pid in node.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in argv and b"--rdzv-id" in argv and any(a.endswith(b"mtcore") for a in argv):
            return pid
    raise AssertionError(f"no mtcore train launcher on {node.hostname}")


def test_a_sigterm_to_one_node_ends_the_step_with_143_and_the_script_requeues(
    cluster, tmp_path, mtcore_script, cli_env
):
    """One node preempted (its launcher alone gets SIGTERM): both nodes' launchers exit
    143 at the same commit, without a restart round; srun returns 143, the script
    requeues the job, and the next run resumes that commit and finishes."""
    cache, steps = tmp_path / "cache", 12
    submitted = tmp_path / "slurm"
    submitted.mkdir()
    env = cli_env(
        PATH=f"{mtcore_script.parent}:{os.environ['PATH']}",
        PYTHONUNBUFFERED="1",
        MTCORE_CONFIG=str(DEFAULT_JOB),
        MTCORE_NPROC_PER_NODE="2",
        MTCORE_ARGS=" ".join(short_run(submitted, cache, steps)),
    )
    done = cluster.command("sbatch", "--parsable", "--gpus-per-node=0", SCRIPT, env=env,
                           cwd=submitted)  # fmt: skip
    assert done.returncode == 0, done.stderr + cluster.logs()
    job = Job(cluster, done.stdout.strip().split(";")[0], submitted)
    job.wait(lambda: job.committed(2), "the commit of step 2")
    os.kill(_launcher_on(cluster.nodes.nodes[1]), 15)
    job.wait(lambda: len(job.runs()) > 1 and STEP.search(job.runs()[1]), "the requeued run")
    job.wait(lambda: job.state() == "COMPLETED", "the job's end")
    assert cluster.job(job.id)["Restarts"] == "1", job.text()
    runs = job.runs()
    assert f"train.sbatch: stopped after a commit; requeueing job {job.id}" in runs[0], runs[0]
    assert "restart 1 of at most" not in runs[0], runs[0]  # no round: the budget is whole
    assert "a SIGTERM to another node or rank of this job stopped it" in runs[0], runs[0]
    step = int(re.search(r"preempted: .* stopped the job after step (\d+)", runs[0]).group(1))
    assert f"the latest commit (step {step}) is this run's ({job.id}): resuming it" in runs[1]
    assert f"done: {steps - step} steps" in runs[1], runs[1]
