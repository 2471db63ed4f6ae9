"""The default job on one host against the same job on two namespace nodes, and recovery times.

    .venv/bin/python benchmarks/bench_multinode.py [--rounds 3 --steps 30] [--recovery 2]

Needs root (network namespaces: ``mtcore.testing.nodes``). The job is
configs/default.yaml (tp2 x pp2, 4 ranks, fp32), shortened to ``--steps`` steps:

* ``one host``: `mtcore train --nproc 4` on this host (loopback);
* ``two nodes``: `mtcore train --nproc 2 --nnodes 2` on each of two nodes, tp2 inside
  a node and the two pipeline stages on different nodes (their traffic crosses a
  veth pair and a bridge, through each node's TCP stack).

Rounds alternate the two, so load from other processes falls on both alike. A step's
time is the trainer's own figure (``s/step`` on each step line, ``logging.interval 1``),
the median over the steps after ``--warmup``; the paired figure is the median over
rounds of the per-round ratio. The bytes that cross the node boundary per step are read
from node0's interface counters at two step lines (every byte: activations and their
gradients, the loss reduction, gloo's framing), beside what the pipeline must send:
per micro-batch one activation forward and one gradient back per tp rank.

``--recovery N``: N times, node1's power is cut after a commit and node1 starts again
(`--max-restarts 1`): the time from the cut to the first step trained after the
resume; then N times node1's cable is cut for good (`--nnodes 1:2`, dp2 x tp2 layout,
collective timeout 15 s): the time until node0 trains alone (its ranks first wait out
the timeout, then the rendezvous's last call, 5 s here).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

from mtcore.testing import nodes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JOB = ROOT / "configs" / "default.yaml"
MTCORE = Path(sys.executable).with_name("mtcore")
STEP = re.compile(r"^step (\d+)/\d+ \| loss [0-9.]+ .*\| ([0-9.]+) s/step")


class Launcher:
    """One `mtcore train` (on a node or on this host), its lines with their arrival times."""

    def __init__(self, argv: list[str], node=None, on_line=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME=nodes.INTERFACE)
        kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.process = node.popen(argv, **kwargs) if node else subprocess.Popen(argv, **kwargs)
        self.lines: list[tuple[float, str]] = []
        self.on_line = on_line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))
            if self.on_line is not None:
                self.on_line(line)

    def wait(self, timeout_s: float = 600) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        if code != 0:
            tail = "".join(line for _, line in self.lines[-30:])
            raise RuntimeError(f"mtcore train exited {code}:\n{tail}")
        return code


def _job(workdir: Path, steps: int, *extra: str) -> list[str]:
    return [
        str(MTCORE), "train", str(DEFAULT_JOB), "--training.steps", str(steps),
        "--training.eval_interval", "0", "--training.sample_prompt", "null",
        "--logging.interval", "1", "--logging.tensorboard_dir", "null",
        "--data.cache_dir", str(workdir / "cache"), *extra,
    ]  # fmt: skip


def _step_times(lines, warmup: int) -> list[float]:
    return [
        float(m.group(2))
        for _, line in lines
        if (m := STEP.match(line)) and int(m.group(1)) > warmup
    ]


def _interface_bytes(node) -> int:
    """Bytes sent and received on the node's interface so far."""
    read = node.run(
        ["cat", f"/sys/class/net/{nodes.INTERFACE}/statistics/tx_bytes",
         f"/sys/class/net/{nodes.INTERFACE}/statistics/rx_bytes"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return sum(int(v) for v in read.stdout.split())


def two_nodes(cluster, workdir: Path, steps: int, warmup: int, run_id: str):
    """Step times of a 2-node run, and the bytes node0's interface moved per step between
    the first timed step and the last step."""
    marks: dict[int, int] = {}
    node0 = cluster.nodes[0]

    def mark(line: str) -> None:
        m = STEP.match(line)
        if m and int(m.group(1)) in (warmup + 1, steps):
            marks[int(m.group(1))] = _interface_bytes(node0)

    extra = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0", "--rdzv-id", run_id]
    launchers = [Launcher(_job(workdir, steps, *extra), node, mark) for node in cluster.nodes]
    for launcher in launchers:
        launcher.wait()
    lines = [entry for launcher in launchers for entry in launcher.lines]
    per_step = (marks[steps] - marks[warmup + 1]) / (steps - warmup - 1)
    return _step_times(lines, warmup), per_step


def pipeline_bytes_per_step() -> int:
    """What 1F1B must move across the stage boundary per step for the default job (fp32):
    per micro-batch, each tp rank sends its activation [micro, seq, hidden] forward and
    receives its gradient back."""
    import yaml

    config = yaml.safe_load(DEFAULT_JOB.read_text())
    model, train, parallel = config["model"], config["training"], config["parallel"]
    microbatches = train["global_batch_size"] // train["micro_batch_size"]
    activation = train["micro_batch_size"] * model["seq_len"] * model["hidden_size"] * 4
    return 2 * activation * microbatches * parallel["tp"]


def throughput(cluster, workdir: Path, rounds: int, steps: int, warmup: int) -> None:
    results: dict[str, list[list[float]]] = {"one host": [], "two nodes": []}
    moved: list[float] = []
    for r in range(rounds):
        one = Launcher(_job(workdir, steps, "--nproc", "4"))
        one.wait()
        results["one host"].append(_step_times(one.lines, warmup))
        times, per_step = two_nodes(cluster, workdir, steps, warmup, f"bench-{r}")
        results["two nodes"].append(times)
        moved.append(per_step)
        print(f"round {r + 1}: one host {statistics.median(results['one host'][-1]):.3f} s/step, "
              f"two nodes {statistics.median(times):.3f} s/step; {load_average()}", flush=True)  # fmt: skip
    base = statistics.median(t for r in results["one host"] for t in r)
    print(f"\n{'layout':<10} {'median s/step':>14} {'ratio':>7} {'paired':>7}")
    for name, per_round in results.items():
        median = statistics.median(t for r in per_round for t in r)
        paired = statistics.median(
            statistics.median(a) / statistics.median(b)
            for a, b in zip(per_round, results["one host"], strict=True)
        )
        print(f"{name:<10} {median:>14.3f} {median / base:>7.3f} {paired:>7.3f}")
    need = pipeline_bytes_per_step()
    print(f"\nbytes across the node boundary per step: {statistics.median(moved) / 2**20:.2f} MiB "
          f"measured (node0's eth0, both ways), {need / 2**20:.2f} MiB of pipeline activations "
          "and gradients")  # fmt: skip


def _first_step_after(lines, marker: str) -> float | None:
    seen = False
    for at, line in lines:
        seen = seen or marker in line
        if seen and STEP.match(line):
            return at
    return None


def recovery(cluster, workdir: Path, times: int) -> None:
    node1 = cluster.nodes[1]
    restart, shrink = [], []
    for i in range(times):
        checkpoints = workdir / f"lost-{i}"
        extra = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node0",
                 "--rdzv-id", f"lost-{i}", "--max-restarts", "1",
                 "--checkpoint.dir", str(checkpoints), "--checkpoint.interval", "1"]  # fmt: skip
        argv = _job(workdir, 40, *extra)
        first = [Launcher(argv, node) for node in cluster.nodes]
        while not (checkpoints / "step_000005" / "manifest.json").is_file():
            time.sleep(0.02)
        node1.kill()
        cut = time.monotonic()
        again = Launcher(argv, node1)
        first[0].wait()
        again.wait()
        resumed = _first_step_after(first[0].lines + again.lines, "checkpoint: resumed from")
        restart.append(resumed - cut)

        checkpoints = workdir / f"cut-{i}"
        extra = ["--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", "node0",
                 "--rdzv-id", f"cut-{i}", "--max-restarts", "1",
                 "--rdzv-conf", "last_call_timeout=5,join_timeout=60",
                 "--training.collective_timeout_s", "15", "--parallel.pp", "1",
                 "--checkpoint.dir", str(checkpoints), "--checkpoint.interval", "1"]  # fmt: skip
        argv = _job(workdir, 40, *extra)
        pair = [Launcher(argv, node) for node in cluster.nodes]
        while not (checkpoints / "step_000005" / "manifest.json").is_file():
            time.sleep(0.02)
        node1.disconnect()
        cut = time.monotonic()
        pair[0].wait()
        resumed = _first_step_after(pair[0].lines, "checkpoint: resumed from")
        shrink.append(resumed - cut)
        node1.kill()
        node1.reconnect()
        print(f"run {i + 1}: node lost and back {restart[-1]:.1f} s, cut off and shrunk "
              f"{shrink[-1]:.1f} s; {load_average()}", flush=True)  # fmt: skip
    print(f"\nfrom the failure to the first new step (median of {times}): node lost and back "
          f"{statistics.median(restart):.1f} s; cut off, dp shrunk {statistics.median(shrink):.1f} s "
          "(of which 15 s collective timeout, 5 s last call)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--recovery", type=int, default=0, metavar="N")
    args = parser.parse_args()
    reason = nodes.unavailable()
    if reason is not None:
        print(f"bench_multinode: {reason}", file=sys.stderr)
        return 2
    print(f"load at start: {load_average()}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    try:
        with nodes.NamespaceCluster(2) as cluster:
            if args.rounds:
                throughput(cluster, workdir, args.rounds, args.steps, args.warmup)
            if args.recovery:
                recovery(cluster, workdir, args.recovery)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
