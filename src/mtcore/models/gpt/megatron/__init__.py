"""Megatron-LM / Megatron-Core GPT checkpoints <-> mtcore GPT (``GPTConfig`` and full
weights).

* ``args``: Megatron-LM's arguments (its ``args`` Namespace, or a launch line's
  ``--num-layers ...``) as a ``GPTConfig``, and the arguments that load an mtcore model;
* ``weights``: Megatron's tensors (whole, or one tensor-parallel rank's shard) as
  mtcore's full weights, and back;
* ``ranks``: a checkpoint's arrangement of them (torch_dist's stacked layers, the
  legacy per-rank state dicts) as full weights, and back.

Reading and writing the checkpoint directories (DCP, the pickled per-rank files) is
``mtcore.training.checkpoint.megatron``; the command is ``mtcore convert``.
"""

from mtcore.models.gpt.megatron.args import (
    MEGATRON_DEFAULTS,
    MODEL_ARGUMENTS,
    MegatronError,
    megatron_args,
    model_config_from_megatron,
)
from mtcore.models.gpt.megatron.ranks import from_dist, from_ranks, to_ranks
from mtcore.models.gpt.megatron.weights import (
    from_megatron_tensors,
    merge_tp_shards,
    split_tp_shards,
    to_megatron_tensors,
)

__all__ = [
    "MEGATRON_DEFAULTS",
    "MODEL_ARGUMENTS",
    "MegatronError",
    "from_dist",
    "from_megatron_tensors",
    "from_ranks",
    "megatron_args",
    "merge_tp_shards",
    "model_config_from_megatron",
    "split_tp_shards",
    "to_megatron_tensors",
    "to_ranks",
]
