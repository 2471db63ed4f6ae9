"""Model checkpoints, for now: the full weights, the configs and the tokenizer.

A checkpoint is a directory ``<dir>/step_<N>/`` with

* ``model.pt``: ``{"format", "step", "model_config", "weights"}``, plain tensors and
  Python values only, so ``torch.load(path, weights_only=True)`` reads it; the
  weights are unsharded fp32 tensors named as in ``GPT(config)`` (one process),
  whatever layout trained them;
* ``tokenizer.json``: the tokenizer, so ``mtcore generate`` needs nothing else;
* ``config.yaml``: the whole training config, for the record.

``<dir>/latest`` names the newest step directory. Optimizer state, the data
loader position and sharded save/load come with the checkpoint system (a later
issue); these files cannot resume training bit-for-bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from mtcore.models import GPT, ModelConfig

FORMAT = "mtcore-gpt-weights-v1"


def save_checkpoint(
    root: str | Path,
    step: int,
    weights: dict[str, torch.Tensor],
    model_config: ModelConfig,
    train_config,
    tokenizer,
) -> Path:
    """Write ``<root>/step_<step>/`` and point ``<root>/latest`` at it; return the directory.

    model_config: the model as built (vocabulary size filled in from the tokenizer).
    """
    root = Path(root)
    out = root / f"step_{step:06d}"
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "step": step,
        "model_config": model_config.model_dump(mode="json"),
        "weights": weights,
    }
    _atomic(out / "model.pt", lambda f: torch.save(payload, f))
    _atomic(out / "tokenizer.json", lambda f: f.write(tokenizer.hf.to_str().encode()))
    text = yaml.safe_dump(train_config.model_dump(mode="json"), sort_keys=False)
    _atomic(out / "config.yaml", lambda f: f.write(text.encode()))
    _atomic(root / "latest", lambda f: f.write(out.name.encode() + b"\n"))
    return out


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, ``model.pt`` itself, or a checkpoint root (its ``latest``)."""
    path = Path(path).expanduser()
    if path.is_file():
        path = path.parent
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "model.pt").is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (expected {path / 'model.pt'})")
    return path


def load_model(path: str | Path, backend=None) -> tuple[GPT, int, Path]:
    """The one-process model of a checkpoint, its step and its directory."""
    from mtcore.models import single_context

    directory = resolve_checkpoint(path)
    payload = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{directory / 'model.pt'} is not an mtcore GPT checkpoint ({FORMAT})")
    config = ModelConfig.model_validate(payload["model_config"])
    model = GPT(config, single_context(config, backend))
    model.load_state_dict(payload["weights"], strict=True)
    model.train(False)
    return model, int(payload["step"]), directory
