"""Whether a checkpoint's model is the model being trained, checked before any tensor loads.

DCP reads only the tensors it is asked for, so a 4-layer checkpoint would load
into a 2-layer model without a word (layers 2 and 3 left behind). The manifest
records the saved ``ModelConfig``; a difference in what decides the parameters'
names and shapes is an error naming each field, a difference in numerics only
(``rope_theta``, ``norm_eps``, dropout, routing options) is reported and allowed:
fine-tuning may change them on purpose.
"""

from __future__ import annotations

from pathlib import Path

from mtcore.models import ModelConfig
from mtcore.training.checkpoint.manifest import MANIFEST, CheckpointError

# Fields that decide which parameters exist and their shapes.
_STRUCTURE = (
    "style",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "kv_heads",
    "ffn_size",
    "norm",
    "activation",
    "position",
    "tie_embeddings",
    "bias",
    "moe_layer_freq",
)
_MOE_STRUCTURE = ("num_experts", "ffn_size", "shared_ffn_size", "activation")
# Fields that change the numbers a model computes but not its parameters.
_NUMERICS = ("rope_theta", "norm_eps", "dropout")


def _structure(config: ModelConfig) -> dict[str, object]:
    fields = {name: getattr(config, name) for name in _STRUCTURE}
    if config.position == "learned":  # a learned position table has seq_len rows
        fields["seq_len"] = config.seq_len
    moe = config.moe
    fields["moe"] = None if moe is None else {k: getattr(moe, k) for k in _MOE_STRUCTURE}
    return fields


def check_model_matches(saved: dict | None, model: ModelConfig, directory: Path) -> list[str]:
    """Raise CheckpointError when the checkpoint at ``directory`` (manifest's
    ``model_config`` = ``saved``) holds another architecture than ``model``; return
    notes on numerics-only differences (for the log)."""
    if not saved:
        raise CheckpointError(f"{directory / MANIFEST} records no model_config")
    old = ModelConfig.model_validate(saved)
    was, now = _structure(old), _structure(model)
    differ = [f"{k}: checkpoint {was[k]!r}, config {now[k]!r}" for k in now if was.get(k) != now[k]]
    if differ:
        raise CheckpointError(
            f"checkpoint {directory} holds a different model than the config's model section ("
            + "; ".join(differ)
            + "); set the model section to the checkpoint's (its manifest.json's model_config)"
        )
    notes = [
        f"model.{k} {getattr(old, k)!r} -> {getattr(model, k)!r}"
        for k in _NUMERICS
        if getattr(old, k) != getattr(model, k)
    ]
    if old.moe is not None and model.moe is not None and old.moe != model.moe:
        notes.append("model.moe routing options differ from the checkpoint's")
    return notes
