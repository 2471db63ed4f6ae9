"""Reading DCP checkpoints without unpickling arbitrary objects.

torch.distributed.checkpoint reads tensor data with ``torch.load(weights_only=True)``
but its ``.metadata`` file is a plain pickle. ``SafeFileSystemReader`` unpickles it
with an allow-list: the DCP metadata dataclasses, ``torch.Size``, dtypes and
paths; anything else (a pickled function, a ``__reduce__`` payload) is refused
with an error naming it. Non-tensor ("bytes") entries, which DCP would load with
a full unpickler, are refused too: mtcore keeps plain data in JSON files. Every
chunk's storage path must name a file inside the checkpoint directory (no
absolute path, no ``..``), and a tensor file that does not unpickle as weights
is a one-line error naming it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import inspect
import io
import math
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.futures import Future

from mtcore.training.checkpoint.manifest import CheckpointError, check_inside
from mtcore.training.checkpoint.safe_pickle import allowed_global

_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",  # Megatron-Core keeps the save plans in it
)
_DCP_NAMES = {
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "StorageMeta",
    "Metadata",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
    "_StorageInfo",
    "SavePlan",
    "WriteItem",
    "WriteItemType",
    "TensorWriteData",
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES and name in _DCP_NAMES:
            return super().find_class(module, name)
        found = allowed_global(module, name)
        if found is not None:
            return found
        raise CheckpointError(f"refusing to unpickle {module}.{name} from checkpoint metadata")


def load_metadata(path: Path, skip_bytes: bool = False) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with the allow-list. Non-tensor entries are
    refused, or with ``skip_bytes`` left out (never read: Megatron-Core's per-layer
    ``_extra_state``)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except Exception as e:  # truncated or garbled pickle
        raise CheckpointError(f"{path} is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} does not hold DCP metadata ({type(metadata).__name__})")
    for key, entry in list(metadata.state_dict_metadata.items()):
        if skip_bytes and isinstance(entry, BytesStorageMetadata):
            del metadata.state_dict_metadata[key]
        elif not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor; refusing to load it")
    _check_storage(metadata, path)
    for key, entry in metadata.state_dict_metadata.items():
        _check_coverage(key, entry, path)
    return metadata


def _check_coverage(key: str, entry: TensorStorageMetadata, path: Path) -> None:
    """The chunks of ``key`` lie inside its shape and hold each element exactly once: DCP
    fills what no chunk covers with whatever the target held (zeros), without a word.
    Exact and cheap: the chunks' edges cut each axis into intervals, and every cell of
    that grid is counted (a regular split gives one cell per chunk)."""
    size = tuple(entry.size)
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
    for offsets, sizes in chunks:
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(
                o < 0 or n < 0 or o + n > whole
                for o, n, whole in zip(offsets, sizes, size, strict=True)
            )
        ):
            raise CheckpointError(
                f"{path}: a chunk of {key!r} (offsets {list(offsets)}, sizes {list(sizes)}) "
                f"lies outside its shape {list(size)}"
            )
    if math.prod(size) == 0:
        return
    edges = []
    for axis, whole in enumerate(size):
        cuts = {0, whole}
        for offsets, sizes in chunks:
            cuts.update((offsets[axis], offsets[axis] + sizes[axis]))
        edges.append(sorted(cuts))
    counts = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for offsets, sizes in chunks:
        cells = tuple(
            slice(bisect.bisect_left(e, o), bisect.bisect_left(e, o + n))
            for e, o, n in zip(edges, offsets, sizes, strict=True)
        )
        counts[cells] += 1
    if not bool((counts == 1).all()):
        covered = sum(math.prod(sizes) for _, sizes in chunks)
        raise CheckpointError(
            f"{path}: the chunks of {key!r} do not cover its shape {list(size)} once "
            f"({covered:,} of {math.prod(size):,} elements stored, overlaps counted): a "
            "partial or corrupt checkpoint"
        )


def _check_storage(metadata: Metadata, path: Path) -> None:
    """Every chunk is stored in a file inside the metadata's directory."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path} does not say where its tensors are stored")
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    for name in sorted(names, key=repr):
        if not isinstance(name, str):
            raise CheckpointError(f"{path}: a storage path is {type(name).__name__}, not a name")
        check_inside(name, path)
        if not (path.parent / name).is_file():
            raise CheckpointError(f"{path}: storage file {path.parent / name} is missing")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through the allow-listed unpickler
    (``skip_bytes``: as ``load_metadata``'s)."""

    def __init__(self, path, skip_bytes: bool = False, **kwargs):
        super().__init__(path, **kwargs)
        self.skip_bytes = skip_bytes

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = load_metadata(Path(self.path) / name, self.skip_bytes)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's read, one file at a time, so that a file whose tensors do not unpickle
        as weights (``torch.load(weights_only=True)`` refuses it) is named in one line."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError,
                    AssertionError) as e:  # fmt: skip
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(f"{Path(self.path) / name} is unreadable: {first}") from None
        done = Future()
        done.set_result(None)
        return done


def tensor_shapes(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every logical tensor in a DCP directory: ``key -> (global shape, dtype)``."""
    metadata = load_metadata(directory / ".metadata")
    return {
        key: (entry.size, entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
    }


class _StagedWriter(FileSystemWriter):
    """A writer for tensors that are a host copy already (``host_copy``): it stages them
    as they are. DCP's own staging deep-copies a DTensor, mesh and process group
    included, which fails. A writer that is an ``AsyncStager`` is its own stager in
    every DCP (torch 2.7's ``async_save`` has no ``async_stager`` argument)."""

    def stage(self, state_dict):
        return state_dict


def dcp_save(tensors: dict, directory: Path, world: int, **kwargs):
    """``dcp.save`` (or ``async_save`` with ``run_async``, of a ``host_copy``) into
    ``directory``; one process (``world == 1``) runs without a process group."""
    run_async = kwargs.pop("run_async", False)
    writer = (_StagedWriter if run_async else FileSystemWriter)(str(directory))
    fn = dcp.async_save if run_async else dcp.save
    with _quiet():
        if world == 1:
            kwargs.pop("process_group", None)
            # torch 2.7's async_save has no no_dist: without a process group it runs
            # the save without one anyway.
            if "no_dist" in inspect.signature(fn).parameters:
                kwargs["no_dist"] = True
        return fn(tensors, storage_writer=writer, **kwargs)


def dcp_load(targets: dict, directory: Path, world: int, skip_bytes: bool = False) -> None:
    """``dcp.load`` through ``SafeFileSystemReader``, in place into ``targets``. A
    CheckpointError on any rank is raised as itself (DCP wraps it, with tracebacks)."""
    with _quiet():
        kwargs = {"no_dist": True} if world == 1 else {}
        reader = SafeFileSystemReader(str(directory), skip_bytes=skip_bytes)
        try:
            dcp.load(targets, storage_reader=reader, **kwargs)
        except CheckpointException as e:
            failures = [error for _, (error, _) in sorted(e.failures.items())]
            ours = [error for error in failures if isinstance(error, CheckpointError)]
            if ours:
                raise CheckpointError(str(ours[0])) from None
            raise


@contextlib.contextmanager
def _quiet():
    """DCP warns on every one-process call that it assumes one process: it is meant. Its
    writer in torch 2.7 calls ``tensor.storage()``, which warns "TypedStorage is
    deprecated" on every rank: torch's own call, nothing a user can act on. (A
    background save warns from its own thread, so the filters stay installed.)"""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    warnings.filterwarnings(
        "ignore",
        message="TypedStorage is deprecated",
        module="torch.distributed.checkpoint.filesystem",
    )
    yield
