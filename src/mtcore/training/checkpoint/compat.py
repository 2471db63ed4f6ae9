"""Whether a checkpoint's model is the model being trained, checked before any tensor loads.

DCP reads only the tensors it is asked for, so a 4-layer checkpoint would load
into a 2-layer model without a word (layers 2 and 3 left behind). The manifest
records the saved model config; a difference in what decides the parameters'
names and shapes (``FamilyConfig.structure``) is an error naming each field, a
difference in numerics only (``FamilyConfig.numerics``: ``rope_theta``, ``norm_eps``,
dropout, routing options) is reported and allowed: fine-tuning may change them on
purpose. A checkpoint of another family is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

from mtcore.models import FamilyConfig, FamilyError, parse_model_config
from mtcore.training.checkpoint.manifest import MANIFEST, CheckpointError


def saved_model_config(saved: dict | None, directory: Path) -> FamilyConfig:
    """The model config a checkpoint's manifest records (one written before families
    existed has no ``family``: a GPT's)."""
    if not saved:
        raise CheckpointError(f"{directory / MANIFEST} records no model_config")
    try:
        return parse_model_config(saved)
    except FamilyError as e:
        raise CheckpointError(f"{directory / MANIFEST}: its model_config does not parse: {e}") from None


def check_model_matches(saved: dict | None, model: FamilyConfig, directory: Path) -> list[str]:
    """Raise CheckpointError when the checkpoint at ``directory`` (manifest's
    ``model_config`` = ``saved``) holds another architecture than ``model``; return
    notes on numerics-only differences (for the log)."""
    old_family = (saved or {}).get("family", "gpt")
    if saved and old_family != model.family:
        raise CheckpointError(
            f"checkpoint {directory} holds a {old_family} model, but the config trains a "
            f"{model.family} model (model.family)"
        )
    old = saved_model_config(saved, directory)
    was, now = old.structure(), model.structure()
    differ = [f"{k}: checkpoint {was.get(k)!r}, config {now[k]!r}" for k in now if was.get(k) != now[k]]
    if differ:
        raise CheckpointError(
            f"checkpoint {directory} holds a different model than the config's model section ("
            + "; ".join(differ)
            + "); set the model section to the checkpoint's (its manifest.json's model_config)"
        )
    old_numerics, new_numerics = old.numerics(), model.numerics()
    notes = []
    for key, value in new_numerics.items():
        if old_numerics.get(key) != value:
            if isinstance(value, dict):
                notes.append(f"model.{key} options differ from the checkpoint's")
            else:
                notes.append(f"model.{key} {old_numerics.get(key)!r} -> {value!r}")
    return notes
