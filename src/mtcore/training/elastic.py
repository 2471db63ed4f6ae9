"""What torch's elastic agent tells a rank about its job.

``torchrun`` (and ``mtcore train``, which runs the same agent) gives every rank
the job's run id, ``TORCHELASTIC_RUN_ID``: the ``--rdzv-id`` of a multi-node
job, a fresh id per launch with ``--standalone``. It is the same on every node
and across restarts, so it tells a restarted rank, a replacement node or a
requeued Slurm job (``--rdzv-id $SLURM_JOB_ID``) which checkpoints are its own
job's. ``TORCHELASTIC_RESTART_COUNT`` counts this node's agent's restarts (a
replacement node's agent starts at 0 while the others count on).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


@dataclass(frozen=True)
class ElasticRun:
    """run_id: None outside the elastic agent; restart: this agent's restart count."""

    run_id: str | None = None
    restart: int = 0
    max_restarts: int | None = None

    @classmethod
    def from_environment(cls, environ=None) -> ElasticRun:
        environ = os.environ if environ is None else environ
        restart = environ.get(RESTART_COUNT_ENV, "0")
        most = environ.get(MAX_RESTARTS_ENV, "")
        return cls(
            run_id=environ.get(RUN_ID_ENV) or None,
            restart=int(restart) if restart.isdecimal() else 0,
            max_restarts=int(most) if most.isdecimal() else None,
        )


def describe_nodes(backend, rank: int, world: int, device) -> list[str]:
    """One line per node of a multi-node job (collective; ``[]`` on one host): its ranks and
    the address they bind for the backend's traffic between nodes, so a job's first lines
    say which interface each node uses (``mtcore.backend.network``)."""
    import socket

    from mtcore.backend import network
    from mtcore.training.checkpoint.checkpointer import gather_json

    binds = network.bindings(backend.collective.interface_variables)
    mine = {str(rank): [socket.gethostname(), "; ".join(b.describe() for b in binds)]}
    every = gather_json(mine, backend.collective, world, device)
    hosts: dict[str, list[int]] = {}
    for r, (host, _) in sorted(every.items(), key=lambda item: int(item[0])):
        hosts.setdefault(host, []).append(int(r))
    if len(hosts) < 2:
        return []
    return [
        f"node {host}: ranks {_spans(ranks)}: {every[str(ranks[0])][1]}"
        for host, ranks in hosts.items()
    ]


def _spans(ranks: list[int]) -> str:
    """``0-3, 8`` for [0, 1, 2, 3, 8]."""
    spans, start = [], ranks[0]
    for previous, current in zip(ranks, [*ranks[1:], None], strict=True):
        if current != previous + 1:
            spans.append(f"{start}-{previous}" if previous > start else str(start))
            start = current
    return ", ".join(spans)
