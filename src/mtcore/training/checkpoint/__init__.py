"""Checkpoints (transitional: the weights-only format while the DCP system lands)."""

from mtcore.training.checkpoint._old import (
    FORMAT,
    load_model,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = ["FORMAT", "load_model", "resolve_checkpoint", "save_checkpoint"]
