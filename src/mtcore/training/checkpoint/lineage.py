"""Which run a checkpoint continues, so that a new run never writes over another's.

Every run with the same config saves into the same ``checkpoint.dir``
(``runs/<run_name>/checkpoints``). A run that started afresh there would move
``latest`` back to its own early steps and replace the other run's step
directories one by one. So each commit records its *lineage*: an id minted when
a run starts at step 0 and kept by every run that resumes it (restarts, requeues,
``--checkpoint.resume true``), and the fingerprint of the config that wrote it
(``fingerprint``). A run that finds ``checkpoint.dir``'s latest commit of another
lineage (``decide``):

* continues it when asked (``checkpoint.resume``), when it is the same elastic run
  (its run id, ``TORCHELASTIC_RUN_ID``), or when that lineage is an unfinished run
  of this very config: the same command continues after a preemption on one node
  as it does across nodes with a job id;
* starts afresh over it only with ``checkpoint.overwrite: true``; its first commit
  then removes the other lineage's steps, so ``latest`` never goes backwards over a
  lineage that is still there;
* else is refused in one line (``mtcore train`` exits 2 before any rank starts).

Rank 0 checks again before every commit (``check_commit``): nothing moves
``latest`` over another lineage or replaces one of its steps.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import NamedTuple

from mtcore.training.checkpoint import manifest as mf

# Config keys that say how to start, not what the run is: the run they start is the same.
_NOT_THE_RUN = {"checkpoint": ("resume", "overwrite")}


def fingerprint(config) -> str:
    """sha256 of ``config`` (a ``TrainConfig``) as JSON, without ``checkpoint.resume`` and
    ``checkpoint.overwrite`` and with only ``logging.run_name`` of its logging (how a run
    reports, traces or profiles changes none of its steps): two runs of one command (file
    and overrides) have the same."""
    data = config.model_dump(mode="json")
    for section, keys in _NOT_THE_RUN.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    data["logging"] = {"run_name": (data.get("logging") or {}).get("run_name")}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def new_lineage(config_fingerprint: str | None) -> dict:
    return {"id": uuid.uuid4().hex[:12], "config": config_fingerprint}


def lineage_of(manifest: dict) -> dict | None:
    found = manifest.get("lineage")
    return found if isinstance(found, dict) and isinstance(found.get("id"), str) else None


def latest_commit(root: str | Path, report: bool = True) -> dict | None:
    """What a run must know of ``root``'s latest commit: ``{"step", "run_id", "kind",
    "lineage", "directory"}``; None when ``root`` holds none. One process (rank 0).
    ``report``: warn of uncommitted saves (not while this run's own is being written)."""
    root = Path(root).expanduser()
    if not mf.has_checkpoint(root):
        return None
    try:
        directory = mf.resolve_checkpoint(root, report=report)
        manifest = mf.read_manifest(directory)
    except mf.CheckpointError:  # loading it reports the problem
        return {"step": None, "run_id": None, "kind": None, "lineage": None, "directory": None}
    run = manifest.get("run") if isinstance(manifest.get("run"), dict) else {}
    return {
        "step": manifest["step"],
        "run_id": run.get("id"),
        "kind": manifest.get("kind"),
        "lineage": lineage_of(manifest),
        "directory": str(directory),
    }


class Start(NamedTuple):
    """How a run starts on ``checkpoint.dir``: ``resume`` its latest commit or not; the
    ``lineage`` its commits record; ``note``: a line to say (None: nothing)."""

    resume: bool
    lineage: dict
    note: str | None = None


def decide(config, latest: dict | None, run_id: str | None, config_fingerprint: str) -> Start:
    """How this run starts on its ``checkpoint.dir`` whose latest commit is ``latest``
    (``latest_commit``), or a CheckpointError naming the directory and the three ways on."""
    ck, steps = config.checkpoint, config.training.steps
    if latest is None:
        return Start(False, new_lineage(config_fingerprint))
    theirs = latest.get("lineage")
    continued = dict(theirs) if theirs else new_lineage(config_fingerprint)
    if ck.resume or (run_id is not None and latest.get("run_id") == run_id):
        return Start(True, continued)
    if latest.get("kind") == "weights":  # an imported model at step 0: no run to protect
        return Start(False, new_lineage(config_fingerprint))
    root, step = Path(ck.dir).expanduser(), latest.get("step")
    same_config = theirs is not None and theirs.get("config") == config_fingerprint
    if same_config and isinstance(step, int) and step < steps:
        note = (
            f"checkpoint: the latest commit (step {step} of {steps}) is an unfinished run of "
            "this same config: resuming it (--checkpoint.overwrite true starts afresh instead)"
        )
        return Start(True, continued, note)
    if ck.overwrite:
        note = (
            f"checkpoint: --checkpoint.overwrite: starting afresh in {root}; the first commit "
            f"removes the earlier run's checkpoints (latest step {step})"
        )
        return Start(False, new_lineage(config_fingerprint), note)
    if same_config:
        raise mf.CheckpointError(
            f"checkpoint.dir {root} holds this config's finished run (step {step} of "
            f"{steps}); train it further with --checkpoint.resume true and a larger "
            "--training.steps, train it again from step 1 with --checkpoint.overwrite true, "
            "or give this run its own directory (--checkpoint.dir or --logging.run_name)"
        )
    raise mf.CheckpointError(
        f"checkpoint.dir {root} holds another run's checkpoints (latest "
        f"{f'step {step}' if step is not None else 'commit unreadable'}, written "
        "by another config or a run that started afresh); this run would start at step 1 "
        "over them. Continue that run with --checkpoint.resume true, give this one its own "
        "directory (--checkpoint.dir or --logging.run_name), or replace them with "
        "--checkpoint.overwrite true"
    )


def check_commit(root: Path, step: int, lineage: dict | None, overwrite: bool) -> None:
    """Rank 0, before committing ``step`` of ``lineage`` into ``root``: a CheckpointError
    when that would move ``latest`` over another lineage or replace one of its steps
    (unless ``overwrite``: this run replaces them). Checkpoints without a lineage (written
    before lineages were recorded, or weights only) belong to no one."""
    if lineage is None or overwrite:
        return
    latest = latest_commit(root, report=False)  # this save's own staging is there
    others = []
    if latest is not None and latest["lineage"] and latest["lineage"]["id"] != lineage["id"]:
        others.append(f"its latest commit, step {latest['step']}")
    same_step = root / mf.step_dir_name(step)
    if (same_step / mf.MANIFEST).is_file():
        theirs = lineage_of(_manifest_or_empty(same_step))
        if theirs is not None and theirs["id"] != lineage["id"]:
            others.append(f"its step {step}")
    if others:
        raise mf.CheckpointError(
            f"not committing step {step} into checkpoint.dir {root}: {' and '.join(others)} "
            "belong to another run; give this run its own --checkpoint.dir (or "
            "--logging.run_name), or pass --checkpoint.overwrite true to replace them"
        )


def remove_other_lineages(root: Path, lineage: dict) -> list[int]:
    """Rank 0, after an ``overwrite`` run's commit: delete the committed steps of every
    other lineage (and of none); return their steps."""
    removed = []
    for step, directory in mf.committed_steps(root):
        theirs = lineage_of(_manifest_or_empty(directory))
        if theirs is None or theirs["id"] != lineage["id"]:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(step)
    return removed


def _manifest_or_empty(directory: Path) -> dict:
    try:
        return mf.read_manifest(directory)
    except mf.CheckpointError:
        return {}
