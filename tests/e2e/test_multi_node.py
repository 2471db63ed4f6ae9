"""`mtcore train` across machine boundaries: two "nodes" that are network namespaces.

Each node (``mtcore.testing.nodes``) has its own address in 198.18.0.0/15, hostname
and /dev/shm; one `mtcore train --nnodes 2 --rdzv-endpoint node0` (port 29400, the default) per node runs
torch's elastic agent there, and the agents meet in the c10d rendezvous on node0, as
torchrun's do on a cluster. Compared with the same layout on one host:

* the default job (tp2 inside a node, pp2 across the nodes), with node1's power cut
  after a random commit and node1 started again (a replacement): node0's agent
  restarts its ranks, both resume from the last commit, and every loss (full
  precision, from TensorBoard) and the final weights equal the one-host run's, bit
  for bit; and dp2 x tp2 with ZeRO-1, cut off from the network for good: node0
  goes on alone at dp1, resharding the checkpoint; node1's ranks give up within the
  collective timeout and commit nothing; losses after the shrink equal a fresh run
  from that checkpoint at 2 ranks; and a SIGTERM to one node's launcher only (node1,
  then node0, which hosts the rendezvous): both launchers exit 143 without a restart
  round, and the same command on both nodes resumes the commit; another --nproc on each
  node: both launchers exit 2 with one line naming --nproc; an endpoint outside the
  cluster's subnet: one line, without torch's store retry warnings. All are slow (about
  a minute each): `make test-cluster` runs them, in CI too; the default suite runs doctor
  on a node.

Needs root (namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mtcore.testing import nodes
from mtcore.testing.processes import rank_pids
from mtcore.testing.runs import by_step, short_run, tensorboard_scalars, weight_differences
from mtcore.training.checkpoint import manifest as mf

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JOB = ROOT / "configs" / "default.yaml"
STEPS = 8


def _short(directory: Path, cache: Path) -> list[str]:
    """The default job's overrides for a short run: every step logged and committed."""
    return [*short_run(directory, cache, STEPS), "--checkpoint.dir", str(directory / "checkpoints")]


@pytest.fixture(scope="module")
def cluster():
    reason = nodes.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with nodes.NamespaceCluster(2) as made:
        yield made


class Job:
    """One `mtcore train` per node, all joining one rendezvous on node0."""

    def __init__(self, cluster, mtcore_script, cli_env, directory: Path, args: list[str]):
        self.cluster, self.directory, self.args = cluster, directory, args
        self.command = [str(mtcore_script), "train", *args]
        self.env = cli_env(GLOO_SOCKET_IFNAME=nodes.INTERFACE, PYTHONUNBUFFERED="1")
        self.launchers: dict[int, subprocess.Popen] = {}
        self.logs: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)

    def start(self, node) -> subprocess.Popen:
        log = self.directory / f"{node.hostname}.{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as out:
            launcher = node.popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.launchers[node.index] = launcher
        return launcher

    def text(self, tail: int | None = None) -> str:
        """Every log, or the last ``tail`` characters of each (for assertion messages)."""
        return "\n".join(
            f"== {log.name}\n{log.read_text()[-tail if tail else 0 :]}" for log in self.logs
        )

    def wait_for_commit(self, step: int, timeout_s: float = 240) -> None:
        manifest = self.directory / "checkpoints" / mf.step_dir_name(step) / mf.MANIFEST
        deadline = time.monotonic() + timeout_s
        while not manifest.is_file():
            dead = {i: p.returncode for i, p in self.launchers.items() if p.poll() is not None}
            assert not dead, f"launchers ended {dead} before step {step}:\n{self.text(3000)}"
            assert time.monotonic() < deadline, f"no commit of step {step}:\n{self.text(3000)}"
            time.sleep(0.02)

    def finish(self, timeout_s: float = 300) -> dict[int, int]:
        for launcher in self.launchers.values():
            try:
                launcher.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                launcher.kill()
        return {i: p.returncode for i, p in self.launchers.items()}


def _rendezvous(run_id: str, nnodes: str, **extra: str) -> list[str]:
    args = ["--nproc", "2", "--nnodes", nnodes, "--rdzv-endpoint", "node0"]
    args += ["--rdzv-id", run_id]
    for flag, value in extra.items():
        args += [f"--{flag.replace('_', '-')}", value]
    return args


def _one_host(run_mtcore, config, directory: Path, nproc: int, *overrides) -> str:
    out = run_mtcore("train", config, "--nproc", str(nproc), *overrides, PYTHONUNBUFFERED="1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # about 50 s: make test-cluster (in CI) runs it
def test_pp_across_two_nodes_equals_one_host_through_a_lost_node(
    cluster, tmp_path, run_mtcore, mtcore_script, cli_env
):
    cache = tmp_path / "cache"
    one_host = tmp_path / "one_host"
    _one_host(run_mtcore, DEFAULT_JOB, one_host, 4, *_short(one_host, cache))
    expected = by_step(tensorboard_scalars(one_host / "tensorboard"))
    assert sorted(expected) == list(range(1, STEPS + 1))

    two_nodes = tmp_path / "two_nodes"
    args = [str(DEFAULT_JOB), *_short(two_nodes, cache)]
    args += _rendezvous("pp-across-nodes", "2", max_restarts="1")
    job = Job(cluster, mtcore_script, cli_env, two_nodes, args)
    node0, node1 = cluster.nodes
    try:
        job.start(node0), job.start(node1)
        after = random.randint(2, STEPS - 3)
        job.wait_for_commit(after)
        node1.kill()  # a power cut: its agent and ranks die at once
        cut = time.monotonic()
        job.start(node1)  # the node comes back (or a replacement with its name)
        codes = job.finish()
        recovered_in = time.monotonic() - cut
    finally:
        node1.kill()
        node0.kill()
    log = job.text()
    assert codes == {0: 0, 1: 0}, f"cut after step {after} committed:\n{log}"
    assert "restart 1 of at most 1 (a rank stopped or a node was lost): resuming from" in log, log
    assert "checkpoint: resumed from" in log, log
    for node in cluster.nodes:  # the first lines name the rendezvous and each node's address
        assert f"node {node.hostname} joins the c10d rendezvous at node0:29400" in log, log
        assert f"node {node.hostname}: ranks " in log and f"binds {node.address} (eth0)" in log

    # Every step before and after the cut (steps trained twice: the same value twice).
    got = by_step(tensorboard_scalars(two_nodes / "tensorboard"))
    assert got == expected, f"cut after step {after}:\n{log}"
    differ = weight_differences(one_host / "checkpoints", two_nodes / "checkpoints")
    assert not differ, f"final weights differ from one host's: {differ[:5]}"
    print(f"node lost after step {after}: the job ended {recovered_in:.1f} s after the cut")


@pytest.mark.slow
def test_a_node_cut_off_for_good_shrinks_the_job_and_commits_nothing_after(
    cluster, tmp_path, run_mtcore, mtcore_script, cli_env
):
    cache, timeout_s = tmp_path / "cache", 15
    layout = ["--parallel.pp", "1", "--parallel.zero1", "true"]  # tp2 x dp2 on 4 ranks
    one_host = tmp_path / "one_host"
    _one_host(run_mtcore, DEFAULT_JOB, one_host, 4, *_short(one_host, cache), *layout)
    expected = by_step(tensorboard_scalars(one_host / "tensorboard"))

    two_nodes = tmp_path / "two_nodes"
    args = [str(DEFAULT_JOB), *_short(two_nodes, cache), *layout]
    args += ["--training.collective_timeout_s", str(timeout_s)]
    rdzv_conf = "last_call_timeout=5,join_timeout=30"
    args += _rendezvous("cut-off", "1:2", max_restarts="1", rdzv_conf=rdzv_conf)
    job = Job(cluster, mtcore_script, cli_env, two_nodes, args)
    node0, node1 = cluster.nodes
    try:
        job.start(node0), job.start(node1)
        after = random.randint(2, STEPS - 4)
        job.wait_for_commit(after)
        node1.disconnect()  # the cable: node1's processes live on, unreachable
        cut = time.monotonic()
        survivor = job.launchers[0]
        survivor.wait(timeout=300)
        shrunk_in = time.monotonic() - cut
        # The cut-off ranks give up within the collective timeout (their agent then waits
        # for a rendezvous it cannot reach, and gives up too).
        while rank_pids(among=node1.pids()) and time.monotonic() - cut < timeout_s + 30:
            time.sleep(0.2)
        ranks_left = rank_pids(among=node1.pids())
        left_behind = job.launchers[1]
        left_behind.wait(timeout=300)
        gave_up_in = time.monotonic() - cut
    finally:
        node1.reconnect()
        node1.kill()
        node0.kill()
    log = job.text()
    assert survivor.returncode == 0, log
    assert left_behind.returncode != 0, log
    assert ranks_left == {}, f"ranks still running on the cut-off node: {ranks_left}\n{log}"
    assert "lost the rendezvous at node0:29400" in log, log
    assert "leaked" not in log, log  # the cut-off launcher's exit tidies up as a normal one
    assert "resharded" in log, log

    checkpoints = two_nodes / "checkpoints"
    committed = mf.committed_steps(checkpoints)
    assert [step for step, _ in committed] == list(range(1, STEPS + 1)), log
    for _, directory in committed:  # nothing the cut-off ranks wrote got in
        mf.verify_files(directory, mf.read_manifest(directory))
    resumed = int(re.search(r"checkpoint: resumed from \S+ at step (\d+)", log).group(1))
    assert after <= resumed < STEPS

    # Before the cut: the one-host run's values; after: a fresh 2-rank run from that commit.
    got = by_step(tensorboard_scalars(two_nodes / "tensorboard"))
    assert {s: got[s] for s in range(1, resumed + 1)} == {
        s: expected[s] for s in range(1, resumed + 1)
    }
    assert not weight_differences(
        checkpoints / mf.step_dir_name(resumed),
        one_host / "checkpoints" / mf.step_dir_name(resumed),
    )
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        checkpoints / mf.step_dir_name(resumed), fresh / "checkpoints" / mf.step_dir_name(resumed)
    )
    (fresh / "checkpoints" / mf.LATEST).write_text(mf.step_dir_name(resumed) + "\n")
    _one_host(run_mtcore, DEFAULT_JOB, fresh, 2, *_short(fresh, cache), *layout,
              "--checkpoint.resume", "true")  # fmt: skip
    after_shrink = by_step(tensorboard_scalars(fresh / "tensorboard"))
    assert {s: got[s] for s in after_shrink} == after_shrink
    assert not weight_differences(checkpoints, fresh / "checkpoints")
    print(
        f"cut off after step {after}: node0 finished {shrunk_in:.1f} s after the cut, "
        f"node1 gave up after {gave_up_in:.1f} s (timeout {timeout_s} s)"
    )


@pytest.mark.slow  # about 40 s: make test-cluster
@pytest.mark.parametrize("preempted", [1, 0])  # node1; node0, which hosts the rendezvous
def test_sigterm_to_one_node_ends_the_job_on_every_node_with_143_and_it_continues(
    cluster, tmp_path, mtcore_script, cli_env, preempted
):
    """A preempted pod or Slurm node: SIGTERM to one node's launcher only. Every node's
    ranks stop at the same step and commit it; every launcher exits 143 (what Slurm's
    script requeues and the Kubernetes examples retry), none starts a new round (which
    would use up --max-restarts); the same command on both nodes continues the commit."""
    steps, cache = 12, tmp_path / "cache"
    directory = tmp_path / "two_nodes"
    args = [str(DEFAULT_JOB), *short_run(directory, cache, steps)]
    args += ["--checkpoint.dir", str(directory / "checkpoints")]
    args += _rendezvous(f"preempt-{preempted}", "2", max_restarts="3")
    job = Job(cluster, mtcore_script, cli_env, directory, args)
    node0, node1 = cluster.nodes
    try:
        job.start(node0), job.start(node1)
        job.wait_for_commit(2)
        launcher = job.launchers[preempted]
        assert b"train" in Path(f"/proc/{launcher.pid}/cmdline").read_bytes()
        launcher.send_signal(signal.SIGTERM)
        codes = job.finish()
        first = job.text()
        assert codes == {0: 143, 1: 143}, first
        assert "restart 1 of at most 3" not in first, first
        stop = re.search(r"preempted: .* stopped the job after step (\d+): committed ([^;\s]+)", first)
        assert stop, first
        step = int(stop.group(1))
        assert step < steps and stop.group(2).endswith(mf.step_dir_name(step)), first
        assert "a SIGTERM to another node or rank of this job stopped it after step" in first
        assert "stopped by SIGTERM" in first  # the preempted node's own line
        assert "Traceback" not in first, first
        # The same command on both nodes (same --rdzv-id): the commit of the stop, by itself.
        job.start(node0), job.start(node1)
        codes = job.finish()
    finally:
        node1.kill()
        node0.kill()
    log = job.text()
    assert codes == {0: 0, 1: 0}, log
    assert f"checkpoint: the latest commit (step {step}) is this run's (preempt-{preempted})" in log
    assert f"resumed from {directory / 'checkpoints' / mf.step_dir_name(step)} at step {step}" in log


@pytest.mark.slow  # about 30 s: make test-cluster
def test_nodes_with_different_nproc_both_exit_2_with_one_line_naming_it(
    cluster, tmp_path, mtcore_script, cli_env
):
    """``--nproc 2`` on node0 and ``--nproc 1`` on node1 (a layout both world sizes allow):
    each node's launcher exits 2 with one line naming --nproc, no C++ frames, no 143."""
    directory, cache = tmp_path / "unequal", tmp_path / "cache"
    common = [str(DEFAULT_JOB), *short_run(directory, cache, 2), "--checkpoint.dir", "null",
              "--parallel.tp", "1", "--parallel.pp", "1"]  # fmt: skip
    rendezvous = _rendezvous("unequal", "2")
    node0, node1 = cluster.nodes
    job = Job(cluster, mtcore_script, cli_env, directory, [*common, *rendezvous])
    try:
        job.start(node0)
        ones = [*rendezvous[:1], "1", *rendezvous[2:]]  # --nproc 1
        job.command = [str(mtcore_script), "train", *common, *ones]
        job.start(node1)
        codes = job.finish(timeout_s=180)
    finally:
        node1.kill()
        node0.kill()
    assert codes == {0: 2, 1: 2}, job.text(3000)
    for log, ranks in zip(job.logs, (2, 1), strict=True):
        text = log.read_text()
        errors = [line for line in text.splitlines() if "error:" in line]
        assert len(errors) == 1 and "--nproc differs across the nodes" in errors[0], text
        assert f"starts {ranks} rank(s), but the 2 nodes start 3 in all" in errors[0], text
        assert "frame #" not in text and "Traceback" not in text, text


@pytest.mark.slow  # about 20 s: make test-cluster
def test_an_unreachable_endpoint_is_one_line_without_torchs_retry_warnings(
    cluster, tmp_path, mtcore_script, cli_env
):
    """node1 has no route outside its subnet: torch's store client retried with a warning
    and C++ frames each time (50-250 lines); now the launcher's line alone."""
    node1 = cluster.nodes[1]
    command = [str(mtcore_script), "train", str(DEFAULT_JOB),
               *short_run(tmp_path, tmp_path / "cache", 2), "--checkpoint.dir", "null",
               "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "198.19.0.1",
               "--rdzv-id", "nowhere", "--rdzv-conf", "read_timeout=3"]  # fmt: skip
    done = node1.run(command, capture_output=True, text=True, env=cli_env(), timeout=180)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 143, lines
    data = ("training a ", "tokenizing ")  # a first run builds the tokenizer and index
    lines = [line for line in lines if not line.startswith(data)]
    assert len(lines) == 2 and "joins the c10d rendezvous" in lines[0], lines
    assert (
        "cannot reach the rendezvous at 198.19.0.1:29400 (errno: 101 - Network is unreachable)"
        in lines[-1]
    ), lines


def test_doctor_names_the_rendezvous_route_and_the_address_the_ranks_bind(
    cluster, mtcore_script, cli_env
):
    node0, node1 = cluster.nodes
    doctor = [str(mtcore_script), "doctor", "--backend", "cpu", "--rdzv-endpoint", "node0"]
    ready = node1.run(
        doctor, capture_output=True, text=True, env=cli_env(GLOO_SOCKET_IFNAME="eth0")
    )
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert "multi-node: this node node1, rendezvous node0:29400 (--rdzv-endpoint)" in ready.stdout
    assert f"route: node0 is {node0.address}, reached from {node1.address} via eth0" in ready.stdout
    assert "rendezvous port: not listening" in ready.stdout  # no job yet
    assert f"GLOO_SOCKET_IFNAME=eth0: binds {node1.address} (eth0)" in ready.stdout
    # Loopback named by mistake: the other nodes could never connect; said, and exit 1.
    wrong = node1.run(doctor, capture_output=True, text=True, env=cli_env(GLOO_SOCKET_IFNAME="lo"))
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert (
        f"PROBLEM: GLOO_SOCKET_IFNAME: the ranks bind 127.0.0.1 (lo), but node0 is reached from {node1.address} (eth0)"
        in wrong.stdout
    )
    assert "ERROR: this node is not ready for a multi-node job" in wrong.stderr
