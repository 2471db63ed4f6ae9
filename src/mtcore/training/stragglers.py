"""Naming a rank that computes slower than its peers (``logging.straggler_factor``).

Every log line, each rank's mean compute time per step over the interval and its time
in pipeline communication reach rank 0 in the all-reduce that already gathers memory and
CPU time. Compute is, on the host, the CPU time of the rank's main thread inside the
pipeline runner's forward, backward and weight passes (``StepStats.busy_cpu_s``; not the
logging, TensorBoard or data loading rank 0 does besides): a rank waiting for a peer, in
a pipeline receive or inside a tp collective, sleeps in the kernel (gloo, the
shared-memory collectives' futex) and spends none. On a device it is the pipeline
runner's busy time (its forward, backward and weight passes), which holds a tp peer's
wait inside a collective too: there a straggler's tp group is named with it.
Ranks of one pipeline stage do the same work (tp and dp peers), so each is compared with
its stage's median: a rank above ``factor`` times it is named with its host. Its extra
time is its own compute, not waiting: a rank that waits for a slow one shows a normal
compute time and a larger wait. A stage of one rank has no peers and is compared with
the median of every rank.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

import torch

HOST_BYTES = 64


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    compute_s: float
    median_s: float
    wait_s: float
    median_wait_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.median_s

    def line(self, step: int) -> str:
        return (
            f"step {step}: straggler: rank {self.rank} on {self.host} computes "
            f"{self.compute_s * 1e3:.0f} ms/step, {self.ratio:.2f}x its stage's median "
            f"{self.median_s * 1e3:.0f} ms: slow in compute, not waiting (it waits "
            f"{self.wait_s * 1e3:.0f} ms/step, the median {self.median_wait_s * 1e3:.0f})"
        )


def find(
    compute: list[float], wait: list[float], stages: list[int], hosts: list[str], factor: float
) -> list[Straggler]:
    """The ranks whose compute time exceeds ``factor`` times their stage's median."""
    everyone = statistics.median(compute)
    found = []
    for rank, busy in enumerate(compute):
        peers = [r for r, s in enumerate(stages) if s == stages[rank]]
        median = statistics.median(compute[r] for r in peers) if len(peers) > 1 else everyone
        if median > 0 and busy > factor * median:
            waits = statistics.median(wait[r] for r in peers)
            found.append(Straggler(rank, hosts[rank], busy, median, wait[rank], waits))
    return found


def host_names(collective, world: int, device) -> list[str]:
    """Every rank's host name (one all-gather of a few bytes, once per job)."""
    mine = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    if world == 1:
        return [mine.rstrip(b"\0").decode(errors="replace")]
    local = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    every = torch.empty(world * HOST_BYTES, dtype=torch.uint8, device=device)
    collective.all_gather(every, local)
    raw = bytes(every.cpu().tolist())
    return [
        raw[i * HOST_BYTES : (i + 1) * HOST_BYTES].rstrip(b"\0").decode(errors="replace")
        for i in range(world)
    ]
