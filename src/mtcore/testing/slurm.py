"""A real Slurm cluster on namespace nodes, for tests of what users submit with sbatch.

``SlurmCluster(2)`` makes two namespace nodes (``mtcore.testing.nodes``) and
runs one ``slurmd`` on each, so a job step has the node's hostname, address and
/dev/shm, and ``slurmctld`` on node0, the controller a small cluster often
shares with its first compute node. One ``munged`` (on node0, with a key made
for the cluster) serves every daemon and client: its socket is a file, which
every node reaches because the file system is shared (a Unix socket with a
path is not bound to a network namespace). Everything (``slurm.conf``, spool
and state directories, logs, the key) lives in one temporary directory,
removed with the nodes; a process left on a node dies with it.

The configuration is what a container without cgroups allows: processes are
tracked by parentage (``proctrack/linuxproc``), tasks are not bound
(``task/none``), CPUs are the consumable resource (``cons_tres``, no GPUs), no
accounting daemon (``scontrol show job`` tells a job's state). Two times are
short here to keep tests short: a requeued job may start again after
``requeue_delay_s`` (munge's ``cred_expire``, 120 s unless a site sets it) and
the backfill scheduler looks every 5 s (``bf_interval``, 30 s by default). A
job being stopped gets ``kill_wait_s`` between SIGTERM and SIGKILL
(``KillWait``, 30 s by default).

Needs root (namespaces, the daemons) and Debian's ``slurmctld slurmd
slurm-client munge``; ``unavailable()`` says why not, in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mtcore.testing import nodes

# The programs the cluster runs -> the Debian package that has them.
PROGRAMS = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "scontrol": "slurm-client",
    "munged": "munge",
}
INSTALL = "apt-get install -y slurmctld slurmd slurm-client munge"


class SlurmUnavailable(RuntimeError):
    """The cluster could not start; the message says why (with the daemons' logs)."""


def unavailable() -> str | None:
    """Why a Slurm cluster cannot run here (one line), or None when it can."""
    reason = nodes.unavailable()
    if reason is not None:
        return reason
    missing = sorted({package for program, package in PROGRAMS.items() if not _which(program)})
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}: {INSTALL})"
    return None


def _which(program: str) -> str | None:
    return shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class SlurmCluster:
    """``count`` namespace nodes under one Slurm controller; a context manager.

    ``cluster.nodes``: the ``NamespaceCluster``; ``cluster.command(...)`` runs a Slurm
    client (sbatch, scontrol, ...) on node0, where the controller is reachable."""

    def __init__(self, count: int = 2, kill_wait_s: int = 60, requeue_delay_s: int = 10):
        self.kill_wait_s, self.requeue_delay_s = kill_wait_s, requeue_delay_s
        self.nodes = nodes.NamespaceCluster(count)
        self.directory: Path | None = None
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    def __enter__(self) -> SlurmCluster:
        reason = unavailable()
        if reason is not None:
            raise SlurmUnavailable(reason)
        self.nodes.__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def conf(self) -> Path:
        assert self.directory is not None, "the cluster is not set up"
        return self.directory / "slurm.conf"

    def _start(self) -> None:
        self.directory = root = Path(tempfile.mkdtemp(prefix=f"{self.nodes.tag}-slurm-"))
        root.chmod(0o755)  # munged serves its socket only from a path everyone can search
        (root / "munge").mkdir(mode=0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket = root / "munge" / "munge.socket"
        controller = self.nodes.nodes[0]
        self._daemon("munged", controller, [
            _which("munged"), "--foreground", f"--socket={socket}", f"--key-file={key}",
            f"--log-file={root / 'munge' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}",
            f"--pid-file={root / 'munge' / 'munged.pid'}",
        ])  # fmt: skip
        _wait_for(socket.exists, 10, lambda: f"munged made no socket:\n{self.logs()}")
        (root / "ctld").mkdir(mode=0o755)
        for node in self.nodes.nodes:
            (root / node.hostname / "spool").mkdir(mode=0o755, parents=True)
        self.conf.write_text(self.configuration(socket))
        # slurmd 22.05 loads a cgroup plugin whatever else is configured ("disabled" came in
        # 24.05) and its autodetection fails in a node's fresh /sys; named, the v1 plugin
        # loads without touching a cgroup, and nothing configured here uses it.
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._daemon("slurmctld", controller, [_which("slurmctld"), "-D", "-i", "-f", self.conf])
        for node in self.nodes.nodes:
            slurmd = [_which("slurmd"), "-D", "-N", node.hostname, "-f", self.conf]
            self._daemon(f"slurmd-{node.hostname}", node, slurmd)
        _wait_for(self._all_idle, 60, lambda: f"the nodes never became idle:\n{self.logs()}")

    def configuration(self, socket: Path) -> str:
        """slurm.conf: the cluster's paths, its nodes with their addresses, one partition."""
        root, cpus, controller = self.directory, os.cpu_count() or 1, self.nodes.nodes[0]
        node_lines = [
            f"NodeName={node.hostname} NodeAddr={node.address} CPUs={cpus} State=UNKNOWN"
            for node in self.nodes.nodes
        ]
        return "\n".join([
            "ClusterName=mtcore",
            f"SlurmctldHost={controller.hostname}({controller.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket},cred_expire={self.requeue_delay_s}",
            f"StateSaveLocation={root}/ctld/state",
            f"SlurmctldPidFile={root}/ctld/slurmctld.pid",
            f"SlurmctldLogFile={root}/ctld/slurmctld.log",
            f"SlurmdSpoolDir={root}/%n/spool",
            f"SlurmdPidFile={root}/%n/slurmd.pid",
            f"SlurmdLogFile={root}/%n/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=5,bf_interval=5",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=600",
            *node_lines,
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ])  # fmt: skip

    def close(self) -> None:
        """Stop the daemons and whatever a job left on the nodes; remove the nodes and files."""
        for _, process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
        for _, process in reversed(self.daemons):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.nodes.close()  # SIGKILL to every process left in a node's namespace
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def command(self, *argv, env: dict[str, str] | None = None, **kwargs):
        """Run a Slurm client (``sbatch``, ``scontrol``, ...) on node0 under ``env`` (this
        process's environment by default) with SLURM_CONF naming the cluster's
        configuration; keywords as for ``subprocess.run`` (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        env = {**(os.environ if env is None else env), "SLURM_CONF": str(self.conf)}
        return self.nodes.nodes[0].run([str(a) for a in argv], env=env, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (JobState, Restarts, ExitCode, ...)."""
        shown = self.command("scontrol", "-o", "show", "job", job_id)
        if shown.returncode != 0:
            raise SlurmUnavailable(f"scontrol show job {job_id}: {shown.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))

    def logs(self) -> str:
        """The tail of every daemon's log and output (for a failure's message)."""
        if self.directory is None:
            return ""
        found = sorted(self.directory.glob("*/*.log")) + sorted(self.directory.glob("*.out"))
        return "\n".join(f"== {path}\n{path.read_text()[-2000:]}" for path in found)

    def _daemon(self, name: str, node: nodes.Node, argv: list) -> None:
        with open(self.directory / f"{name}.out", "w") as out:
            process = node.popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT)
        self.daemons.append((name, process))

    def _all_idle(self) -> bool:
        for name, process in self.daemons:
            if process.poll() is not None:
                raise SlurmUnavailable(f"{name} exited ({process.returncode}):\n{self.logs()}")
        shown = self.command("sinfo", "-h", "-N", "-o", "%N %t")
        states = dict(line.split() for line in shown.stdout.splitlines() if line.strip())
        return shown.returncode == 0 and all(
            states.get(node.hostname) == "idle" for node in self.nodes.nodes
        )


def _wait_for(ready, timeout_s: float, message) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise SlurmUnavailable(message())
        time.sleep(0.2)
