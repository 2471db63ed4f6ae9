"""Megatron-LM / Megatron-Core GPT checkpoints <-> mtcore GPT (``GPTConfig`` and full
weights).

* ``args``: Megatron-LM's arguments (its ``args`` Namespace, or a launch line's
  ``--num-layers ...``) as a ``GPTConfig``, and the arguments that load an mtcore model;
* ``weights``: Megatron's tensors (whole, or one tensor-parallel rank's shard) as
  mtcore's full weights, and back;
* ``ranks``: a checkpoint's arrangement of them (torch_dist's stacked layers, the
  legacy per-rank state dicts) as full weights, and back (``dist``: to torch_dist).

Reading and writing the checkpoint directories (DCP, the pickled per-rank files) is
``mtcore.training.checkpoint.megatron``; the command is ``mtcore convert``. ``args`` loads
with the package (the GPT family names ``MODEL_ARGUMENTS`` without torch); the tensor
modules on first use.
"""

from mtcore import lazy_exports
from mtcore.models.gpt.megatron.args import (
    MEGATRON_DEFAULTS,
    MODEL_ARGUMENTS,
    MegatronError,
    megatron_args,
    model_config_from_megatron,
)

_TENSORS = {
    "from_dist": ".ranks",
    "from_ranks": ".ranks",
    "to_ranks": ".ranks",
    "to_dist": ".dist",
    "from_megatron_tensors": ".weights",
    "merge_tp_shards": ".weights",
    "split_tp_shards": ".weights",
    "to_megatron_tensors": ".weights",
}


__getattr__ = lazy_exports(__name__, _TENSORS)


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
    "to_dist",
    "to_megatron_tensors",
    "to_ranks",
]
