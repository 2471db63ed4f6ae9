"""Megatron-LM / Megatron-Core checkpoint directories: read one as a ``GPTConfig`` and
full weights, write mtcore weights as one.

A Megatron checkpoint root holds ``latest_checkpointed_iteration.txt`` and
``iter_0000100/`` directories (or ``release/``); an iteration directory is either

* **torch_dist** (Megatron-Core ``dist_checkpointing``): ``metadata.json`` naming the
  backend, DCP's ``.metadata`` and ``__R_K.distcp`` files, and ``common.pt`` (the
  arguments). Read with DCP through ``SafeFileSystemReader``: every tensor whole, the
  layers (and experts) stacked on leading axes; or
* **legacy**: ``mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt``, one ``torch.save`` file
  per tensor (TT), pipeline (PPP) and expert (EEE) rank, each with that rank's layers
  numbered from 0 (``model0``, ``model1`` ... under virtual pipeline stages).

Pickles go through ``safe_pickle`` (the allow-list). The tensors' arrangement is the
family's ``MegatronAdapter`` (the GPT family's: ``mtcore.models.gpt.megatron``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from torch import Tensor

from mtcore.models import FamilyConfig, MegatronAdapter, get_family
from mtcore.training.checkpoint.manifest import CheckpointError
from mtcore.training.checkpoint.safe_pickle import torch_file
from mtcore.training.checkpoint.safe_reader import dcp_load, dcp_save, load_metadata

LATEST = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
FAMILY = "gpt"  # Megatron-LM's pretrain_gpt.py models


def _adapter() -> type[MegatronAdapter]:
    return get_family(FAMILY).megatron


def iteration_dir(path: str | Path) -> Path:
    """The iteration directory of a Megatron checkpoint root (its latest) or itself."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    latest = path / LATEST
    if latest.exists():
        directory = path / _iteration_named(latest)
        if not directory.is_dir():
            what = "is a file, not a directory" if directory.exists() else "does not exist"
            raise CheckpointError(f"{latest} names {directory.name}, but {directory} {what}")
    elif (path / "metadata.json").exists() or any(path.glob("mp_rank_*")):
        directory = path
    else:
        raise CheckpointError(
            f"{path} is not a Megatron checkpoint: no {LATEST}, metadata.json or "
            f"mp_rank_*/{LEGACY_FILE}"
        )
    if not (directory / "metadata.json").exists() and not any(directory.glob("mp_rank_*")):
        raise CheckpointError(
            f"{directory} holds no checkpoint (no metadata.json or mp_rank_*/{LEGACY_FILE}): "
            "an empty or unfinished iteration"
        )
    return directory


def _iteration_named(latest: Path) -> str:
    """The iteration directory's name ``latest_checkpointed_iteration.txt`` holds: what
    Megatron-LM writes there is an iteration number or ``release``."""
    raw = regular_file(latest).read_bytes()
    try:
        text = raw.decode("utf-8").strip()
        if "\x00" in text:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "a NUL byte")
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{latest} is not text (a binary or non-UTF-8 file): it should hold an iteration "
            "number or 'release'"
        ) from None
    if text == "release":
        return text
    if not re.fullmatch(r"[0-9]{1,12}", text):
        raise CheckpointError(f"{latest} holds {text[:40]!r}, not an iteration number or 'release'")
    return f"iter_{int(text):07d}"


def regular_file(path: Path) -> Path:
    """``path``, or a CheckpointError when it is missing or not a file (a directory)."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory where a file should be")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    return path


def read_megatron(path: str | Path) -> tuple[FamilyConfig, dict[str, Tensor], int]:
    """``(config, full weights, iteration)`` of a Megatron checkpoint (root or
    iteration directory, torch_dist or legacy). Saved arguments of the wrong kind (text
    where a number belongs) are a CheckpointError naming the directory."""
    directory = iteration_dir(path)
    try:
        return _read(directory)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{directory}: its saved arguments do not fit: {e}") from None


def _read(directory: Path) -> tuple[FamilyConfig, dict[str, Tensor], int]:
    adapter = _adapter()
    if (directory / "metadata.json").exists():
        args, stacked = _read_torch_dist(directory)
        vocab = stacked.get("embedding.word_embeddings.weight")
        config = adapter.config_from_args(args, None if vocab is None else vocab.shape[0])
        weights = adapter.from_dist(config, stacked)
    else:
        args, ranks = _read_legacy(directory)
        vocab = ranks[(0, 0, 0)][0].get("embedding.word_embeddings.weight")
        tp = 1 + max(key[0] for key in ranks)
        config = adapter.config_from_args(args, None if vocab is None else vocab.shape[0] * tp)
        weights = adapter.from_ranks(config, args, ranks)
    return config, weights, int(args.get("iteration") or 0)


def _args_of(saved: object, where: Path) -> dict:
    args = saved.get("args") if isinstance(saved, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(
            f"{where} holds no Megatron-LM arguments ('args'): cannot tell the model"
        )
    found = dict(vars(args))
    iteration = saved.get("iteration")
    if iteration is not None and (type(iteration) is not int or iteration < 0):
        raise CheckpointError(f"{where}: its iteration is {iteration!r:.40}, not a number >= 0")
    found["iteration"] = iteration
    return found


def _read_torch_dist(directory: Path) -> tuple[dict, dict[str, Tensor]]:
    path = regular_file(directory / "metadata.json")
    try:
        backend = json.loads(path.read_bytes().decode("utf-8")).get("sharded_backend")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text (a binary or non-UTF-8 file)") from None
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a JSON object: {e}") from None
    if backend != "torch_dist":
        raise CheckpointError(
            f"{directory}: sharded_backend {backend!r} is not supported (torch_dist)"
        )
    common = regular_file(directory / "common.pt")
    args = _args_of(torch_file(common), common)
    metadata = load_metadata(regular_file(directory / ".metadata"), skip_bytes=True)
    stacked = {
        key: torch.zeros(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if not key.startswith("optimizer.") and "_extra_state" not in key
    }
    dcp_load(stacked, directory, world=1, skip_bytes=True)
    return args, stacked


def _read_legacy(directory: Path) -> tuple[dict, dict[tuple[int, int, int], list[dict]]]:
    """The arguments and ``{(tp, pp, ep): model chunks}`` of a legacy iteration directory.

    Megatron-LM names a rank's directory ``mp_rank_TT``, then ``_PPP`` with pipeline
    parallelism, then ``_EEE`` with expert parallelism: ``mp_rank_00_001`` is pipeline
    rank 1, or expert rank 1 without pipeline parallelism. The saved arguments tell."""
    numbered: dict[tuple[int, ...], Path] = {}
    for sub in sorted(directory.iterdir()):
        match = _RANK_DIR.match(sub.name)
        if match:
            if not sub.is_dir():
                raise CheckpointError(f"{sub} is a file where a directory should be")
            numbered[tuple(int(g) for g in match.groups() if g is not None)] = regular_file(
                sub / LEGACY_FILE
            )
    if not numbered:
        raise CheckpointError(f"{directory} holds no mp_rank_TT[_PPP[_EEE]]/{LEGACY_FILE}")
    first = min(numbered)
    args = _args_of(torch_file(numbered[first]), numbered[first])
    pipeline = int(args.get("pipeline_model_parallel_size") or 1) > 1
    paths = {}
    for numbers, path in numbered.items():
        tp_rank, *rest = numbers
        pp_rank = rest.pop(0) if pipeline and rest else 0
        paths[(tp_rank, pp_rank, rest[0] if rest else 0)] = path
    tp, pp, ep = (1 + max(key[axis] for key in paths) for axis in range(3))
    said = (
        int(args.get("tensor_model_parallel_size") or 1),
        int(args.get("pipeline_model_parallel_size") or 1),
        int(args.get("expert_model_parallel_size") or 1),
    )
    if said != (tp, pp, ep):
        raise CheckpointError(
            f"{directory}: the saved arguments say tp x pp x ep = {' x '.join(map(str, said))}, "
            f"the mp_rank directories {tp} x {pp} x {ep}"
        )
    grid = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]
    missing = [key for key in grid if key not in paths]
    if missing:
        raise CheckpointError(f"{directory}: no {LEGACY_FILE} for (tp, pp, ep) ranks {missing[:3]}")
    return args, {key: _model_chunks(torch_file(paths[key]), paths[key]) for key in grid}


def _model_chunks(saved: object, where: Path) -> list[dict]:
    """The model state dicts of one file: ``model``, or ``model0``, ``model1`` ... (one
    per virtual pipeline stage)."""
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        return [saved["model"]]
    chunks = []
    while isinstance(saved, dict) and isinstance(saved.get(f"model{len(chunks)}"), dict):
        chunks.append(saved[f"model{len(chunks)}"])
    if not chunks:
        raise CheckpointError(f"{where} holds no model state dict ('model' or 'model0')")
    return chunks


def write_megatron_legacy(
    config: FamilyConfig, weights: dict[str, Tensor], out: str | Path, tp: int, pp: int,
    iteration: int = 0, ep: int = 1,
) -> Path:  # fmt: skip
    """Write ``weights`` as a legacy Megatron checkpoint at ``tp`` x ``pp`` (x ``ep``)
    under the root ``out`` (``iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` and
    ``latest_checkpointed_iteration.txt``); returns the iteration directory. Each file
    holds ``args`` (the adapter's ``args_for``: what Megatron-LM needs to build the
    model), ``iteration``, ``checkpoint_version`` and ``model``, that rank's state dict."""
    adapter = _adapter()
    ranks = adapter.to_ranks(config, weights, tp, pp, ep)
    args = argparse.Namespace(**adapter.args_for(config, tp, pp), expert_model_parallel_size=ep)
    directory = Path(out) / f"iter_{iteration:07d}"
    for (tp_rank, stage, expert_rank), model in ranks.items():
        name = f"mp_rank_{tp_rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
        name += f"_{expert_rank:03d}" if ep > 1 else ""
        (directory / name).mkdir(parents=True, exist_ok=True)
        saved = {"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                 "model": model}  # fmt: skip
        torch.save(saved, directory / name / LEGACY_FILE)
    (Path(out) / LATEST).write_text(str(iteration))
    return directory


# What Megatron-Core's dist_checkpointing writes beside the DCP files (metadata.json).
_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}  # fmt: skip


def write_megatron_torch_dist(
    config: FamilyConfig, weights: dict[str, Tensor], out: str | Path, iteration: int = 0
) -> Path:
    """Write ``weights`` as a torch_dist Megatron checkpoint under the root ``out``
    (``iter_N/`` with ``metadata.json``, ``common.pt`` holding the arguments, and DCP's
    files; ``latest_checkpointed_iteration.txt``); returns the iteration directory.
    Every tensor is written whole, so Megatron-Core loads it at any tp x pp."""
    adapter = _adapter()
    if adapter.to_dist is None:
        raise CheckpointError(f"the {config.family} family exports no torch_dist checkpoint")
    tensors, extra_state_keys = adapter.to_dist(config, weights)
    entries: dict[str, object] = {k: v.detach().contiguous() for k, v in tensors.items()}
    for key in extra_state_keys:  # a ShardedObject: DCP torch.saves its data list
        entries[key] = [None]
    directory = Path(out) / f"iter_{iteration:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**adapter.args_for(config, 1, 1), ckpt_format="torch_dist")
    common = {"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
              "num_floating_point_operations_so_far": 0}  # fmt: skip
    torch.save(common, directory / "common.pt")
    dcp_save(entries, directory, world=1)
    (directory / "metadata.json").write_text(json.dumps(_DIST_METADATA))
    (Path(out) / LATEST).write_text(str(iteration))
    return directory
