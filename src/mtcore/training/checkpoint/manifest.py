"""The commit protocol: a checkpoint is visible only once it is complete.

A save writes into ``<root>/step_<N>.partial/``; once every file is on disk,
rank 0 writes ``manifest.json`` (format, step, the layout that saved it, the
model config, and every file with its size and sha256), then renames the
directory to ``<root>/step_<N>/`` and points ``<root>/latest`` at it (write
aside + ``os.replace``). The first rename is the commit: a kill before ``latest``
moves leaves it one commit behind, and resolving the root still finds ``step_N``
(the newest commit of ``latest``'s lineage). A rename is atomic on a POSIX file
system, so a kill at any moment leaves either the old set of checkpoints or the new one: a
``.partial`` directory (or a step directory without a manifest) is never
loaded, and ``resolve_checkpoint`` names it in a warning.

Loading checks the manifest first: its structure (``Manifest``: every key, of
its type), then every file: a missing, truncated or altered file, or a file the
manifest does not list, is an error naming the file, before any byte of it is
deserialised.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

FORMAT = "mtcore-checkpoint-v2"
MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# A committed step set aside while the same step is committed again (``commit``); found
# only when the kill came between the two renames and ``step_N`` is missing.
_SET_ASIDE = re.compile(r"^step_(\d+)\.replaced-\d+$")
_STEP_OF_DIR = re.compile(r"^step_(\d+)(?:\.|$)")

log = logging.getLogger("mtcore.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupted or incompatible.
    The message names the directory or file."""


class IncompleteCheckpointWarning(UserWarning):
    """A save that never committed (a crash or kill mid-save) was found and ignored."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FileEntry(_Strict):
    path: StrictStr
    bytes: StrictInt = Field(ge=0)
    sha256: StrictStr = Field(pattern=r"^[0-9a-f]{64}$")


class SectionEntry(_Strict):
    dim: StrictInt = Field(ge=0)
    sizes: list[StrictInt] = Field(min_length=2)


class Manifest(BaseModel):
    """What ``manifest.json`` must hold (keys written by later versions are kept)."""

    model_config = ConfigDict(extra="allow", strict=True, protected_namespaces=())

    format: Literal["mtcore-checkpoint-v2"]
    step: StrictInt = Field(ge=0)
    kind: Literal["training", "weights"]
    layout: dict[str, Any] | None
    model_config_: dict[str, Any] = Field(alias="model_config", min_length=1)
    sections: dict[str, SectionEntry]
    files: list[FileEntry]


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file, fsync'd, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, header: dict) -> dict:
    """Checksum every file under ``directory`` and write ``manifest.json`` (last)."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files.append(
            {
                "path": path.relative_to(directory).as_posix(),
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )
    manifest = {"format": FORMAT, **header, "files": files}
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


def read_manifest(directory: Path) -> dict:
    """The parsed manifest of a committed checkpoint, checked against ``Manifest``, or a
    CheckpointError naming it."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a committed checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupted: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {found!r} is not {FORMAT!r}")
    try:
        Manifest.model_validate(manifest)
    except ValidationError as e:
        raise CheckpointError(f"{path} is malformed: {_problems(e)}") from None
    for entry in manifest["files"]:
        check_inside(entry["path"], path)
    paths = [entry["path"] for entry in manifest["files"]]
    if len(set(paths)) != len(paths):
        raise CheckpointError(f"{path} is malformed: a file is listed twice")
    m = _STEP_OF_DIR.match(directory.name)
    if m and int(m.group(1)) != manifest["step"]:
        raise CheckpointError(
            f"{path} is malformed: step {manifest['step']} in the directory of step {int(m.group(1))}"
        )
    return manifest


def _problems(error: ValidationError, most: int = 3) -> str:
    """``files.0.bytes: Input should be a valid integer; ...``: one line."""
    found = error.errors()
    parts = [".".join(str(x) for x in e["loc"]) + ": " + e["msg"] for e in found[:most]]
    more = f" (and {len(found) - most} more)" if len(found) > most else ""
    return "; ".join(parts).replace("\n", " ") + more


def check_inside(name: str, source: Path) -> None:
    """``name`` is a plain relative path that stays inside its checkpoint directory."""
    parts = PurePosixPath(name).parts
    if not name or "\\" in name or "\0" in name or name.startswith("/") or ".." in parts:
        raise CheckpointError(f"{source}: file path {name!r} leaves the checkpoint directory")


def verify_files(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists exists with its size and sha256, and every file in
    ``directory`` is listed; raise naming the first one that is not (truncated, altered,
    missing or unlisted)."""
    check_no_links(directory)
    listed = {entry["path"] for entry in manifest["files"]}
    for path in sorted(p for p in directory.rglob("*") if not p.is_dir()):
        name = path.relative_to(directory).as_posix()
        if name != MANIFEST and name not in listed:
            raise CheckpointError(
                f"checkpoint file {path} is not listed in {directory / MANIFEST}; "
                "remove it or restore the checkpoint"
            )
    for entry in manifest["files"]:
        path = directory / entry["path"]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, "
                f"the manifest says {entry['bytes']}"
            )
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupted: its sha256 differs from the manifest's"
            )


def check_no_links(directory: Path) -> None:
    """A CheckpointError naming the first symbolic link in ``directory`` (itself included):
    a checkpoint holds its own files, and a link would have a load read a file outside it
    (whatever the manifest's checksum of the link's target said when it was written)."""
    if directory.is_symlink():
        raise CheckpointError(
            f"checkpoint {directory} is a symbolic link (to {os.readlink(directory)}); "
            "load the directory it names instead"
        )
    for parent, dirs, files in os.walk(directory):  # never follows a linked directory
        for name in sorted(dirs + files):
            path = Path(parent) / name
            if path.is_symlink():
                raise CheckpointError(
                    f"checkpoint file {path} is a symbolic link (to {os.readlink(path)}): a "
                    "checkpoint holds only its own files; replace it with the file itself"
                )


def partial_dirs(root: Path) -> list[Path]:
    """Saves under ``root`` that never committed: ``*.partial`` directories and step
    directories without a manifest."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        uncommitted = _STEP_DIR.match(path.name) and not (path / MANIFEST).is_file()
        if path.name.endswith(PARTIAL_SUFFIX) or uncommitted:
            found.append(path)
    return found


def report_partials(root: Path) -> list[Path]:
    """Warn (and log) about every uncommitted save under ``root``; return them."""
    found = partial_dirs(root)
    for path in found:
        message = (
            f"ignoring incomplete checkpoint {path} (a save that never committed: "
            "the job stopped mid-save)"
        )
        log.warning(message)
        warnings.warn(message, IncompleteCheckpointWarning, stacklevel=3)
    return found


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint under ``root``, oldest first (a
    step set aside by an interrupted re-commit counts while its ``step_N`` is missing)."""
    if not root.is_dir():
        return []
    out, aside = {}, {}
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name) or _SET_ASIDE.match(path.name)
        if m and path.is_dir() and (path / MANIFEST).is_file():
            (out if m.re is _STEP_DIR else aside).setdefault(int(m.group(1)), path)
    return sorted({**aside, **out}.items())


def resolve_checkpoint(path: str | Path, report: bool = True) -> Path:
    """A committed step directory from a step directory, its manifest, or a checkpoint root
    (``latest``, else the newest committed step). Uncommitted saves are reported (unless
    ``report`` is false: a save in flight looks the same), never used."""
    path = Path(path).expanduser()
    if path.is_file():
        path = path.parent
    if (path / MANIFEST).is_file():
        return path
    if path.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(
            f"{path} is an incomplete save (never committed); it cannot be loaded"
        )
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(f"{path} is not a committed checkpoint ({MANIFEST} is missing)")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    if report:
        report_partials(path)
    latest = path / LATEST
    if latest.is_file():
        target = path / read_latest(latest)
        if (target / MANIFEST).is_file():
            return _newest_of_lineage(path, target)
        if _STEP_DIR.match(target.name):  # killed while committing the same step again
            step = int(_STEP_DIR.match(target.name).group(1))
            aside = [p for s, p in committed_steps(path) if s == step]
            if aside:
                return aside[0]
        log.warning("%s names %s, which is not a committed checkpoint", latest, target)
    steps = committed_steps(path)
    if not steps:
        raise CheckpointError(f"no committed checkpoint under {path} (no step_N/{MANIFEST})")
    return steps[-1][1]


def _newest_of_lineage(root: Path, target: Path) -> Path:
    """``target`` (what ``latest`` names), or the newest later commit of its lineage
    (``lineage``): the rename of ``step_N`` is the commit and ``latest`` moves after it, so
    a kill between the two leaves ``latest`` one commit behind, never another run's."""
    try:
        lineage = (json.loads((target / MANIFEST).read_bytes()).get("lineage") or {}).get("id")
        step = int(_STEP_OF_DIR.match(target.name).group(1))
    except (OSError, ValueError, AttributeError, TypeError):
        return target  # loading it says what is wrong
    for later, directory in reversed(committed_steps(root)) if lineage else ():
        if later <= step:
            break
        try:
            theirs = read_manifest(directory).get("lineage")
        except CheckpointError:
            continue
        if isinstance(theirs, dict) and theirs.get("id") == lineage:
            return directory
    return target


def read_latest(latest: Path) -> str:
    """The step directory name a ``latest`` file holds (``step_000500``), read strictly:
    UTF-8, one step directory name; anything else is a CheckpointError naming it."""
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest} is unreadable or corrupted: {e}") from None
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{latest} is corrupted: {name[:40]!r} is not a step directory name")
    return name


def has_checkpoint(root: str | Path) -> bool:
    """True when ``root`` holds at least one committed checkpoint."""
    return bool(committed_steps(Path(root).expanduser()))


def staging_dir(root: Path, step: int, incarnation: str | None = None) -> Path:
    """Where a save of ``step`` is written before its commit: ``step_N.partial``, or
    ``step_N.<incarnation>.partial`` for a job that owns ``root`` (``owner.Ownership``), so
    a rank of an earlier incarnation left running can never write into this one's save."""
    middle = f".{incarnation}" if incarnation else ""
    return root / f"{step_dir_name(step)}{middle}{PARTIAL_SUFFIX}"


def begin(root: Path, step: int, incarnation: str | None = None) -> Path:
    """The empty staging directory for a save of ``step``; stale saves of the same step
    (of any incarnation) are reported and removed."""
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, step, incarnation)
    for stale in partial_dirs(root):
        if stale.name.startswith(step_dir_name(step) + ".") or stale == staging:
            log.warning(
                "removing incomplete checkpoint %s before saving step %d again", stale, step
            )
            shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir()
    return staging


def commit(staging: Path, header: dict, keep_last: int = 0) -> Path:
    """Write the manifest, rename ``staging`` to its step directory, update ``latest`` and
    apply keep-last-K retention (0: keep all). Returns the committed directory."""
    write_manifest(staging, header)
    _fsync_dir(staging)
    root = staging.parent
    final = root / step_dir_name(header["step"])
    old = None
    if final.exists():  # the same step saved again: swap, then drop the old one
        old = root / f"{final.name}.replaced-{os.getpid()}"
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(root)
    tmp = root / (LATEST + ".tmp")
    with open(tmp, "w") as f:  # fsync'd: a power loss never leaves an empty ``latest``
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for aside in root.glob(final.name + ".replaced-*"):  # left by a kill mid-swap
        shutil.rmtree(aside, ignore_errors=True)
    if keep_last > 0:
        apply_retention(root, keep_last, protect=final)
    return final


def apply_retention(root: Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints, and incomplete saves of
    older steps; return what was removed."""
    steps = committed_steps(root)
    removed = []
    for _, path in steps[:-keep_last] if keep_last < len(steps) else []:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    newest = steps[-1][0] if steps else None
    for path in partial_dirs(root):
        m = re.match(r"^step_(\d+)", path.name)
        if newest is not None and m and int(m.group(1)) < newest:
            log.warning("removing incomplete checkpoint %s (older than step %d)", path, newest)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
