"""`mtcore train`'s ranks among the running processes, found in Linux's ``/proc`` by
the name each rank gives itself (``mtcore.training.rank.name_this_rank``): tests stop, kill
or count them as an operator would find them with ``ps``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from mtcore.training.rank import RANK_PROCESS_NAME

_RANK_NAME = re.compile(re.escape(RANK_PROCESS_NAME).replace(r"\{rank\}", r"([0-9]+)") + "$")


def rank_pids(below: int | None = None, among: Iterable[int] | None = None) -> dict[int, int]:
    """``RANK -> pid`` of the live ranks: those descended from process ``below`` when
    given (a launcher's: its rank server's children), among the pids ``among`` when given
    (a namespace node's), else every rank on the machine."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    ranks = {}
    for pid in pids if among is None else among:
        stat = _stat(pid)
        if stat is None or stat[1] == "Z":
            continue
        found = _RANK_NAME.match(stat[0])
        if found and (below is None or _descends(pid, below)):
            ranks[int(found.group(1))] = pid
    return ranks


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def _stat(pid: int) -> tuple[str, str, int] | None:
    """``(name, state, parent pid)`` of ``pid`` from ``/proc/PID/stat``, or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    state, parent = text[text.rindex(")") + 2 :].split()[:2]
    return name, state, int(parent)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        stat = _stat(pid)
        if stat is None:
            return False
        pid = stat[2]
        if pid == ancestor:
            return True
    return False
