"""Checkpoints: sharded save/load through torch.distributed.checkpoint, exact resume,
resharding across layouts, atomic commit, verified and pickle-free loading (docs/checkpoints.md).

* ``Checkpointer``: the trainer's save/load of the whole training state, every rank;
* ``read_model_weights`` / ``write_model_weights`` / ``load_model``: one process, full weights;
* ``resolve_checkpoint``: a committed step directory from a root or step path.
"""

from mtcore.training.checkpoint.checkpointer import Checkpointer, CheckpointWriteError, Loaded
from mtcore.training.checkpoint.manifest import (
    FORMAT,
    CheckpointError,
    IncompleteCheckpointWarning,
    has_checkpoint,
    resolve_checkpoint,
)
from mtcore.training.checkpoint.weights import load_model, read_model_weights, write_model_weights

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "IncompleteCheckpointWarning",
    "Loaded",
    "has_checkpoint",
    "load_model",
    "read_model_weights",
    "resolve_checkpoint",
    "write_model_weights",
]
