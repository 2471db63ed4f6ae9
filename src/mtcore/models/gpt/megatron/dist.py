"""mtcore full weights -> the entries of a torch_dist checkpoint (Megatron-Core's
``dist_checkpointing``), as ``GPTModel.sharded_state_dict()`` names them.

Each tensor is whole: DCP lets every reader take its own shard of it, so one export
loads at any tp x pp. The layers are stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, ...]``) and the norms
have Transformer Engine's names (``self_attention.linear_qkv.layer_norm_weight``), which
Megatron-Core's local layers save under too. Every linear of every layer also has an
``_extra_state`` object (``<name>._extra_state/shard_<layer>_<layers>``; None without
Transformer Engine): a strict load asks for each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.megatron.args import MegatronError, megatron_args
from mtcore.models.gpt.megatron.weights import TE_NORM_NAMES, layer_and_rest, to_megatron_tensors

_LAYER_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
_SAVED_NORM_NAMES = {plain: fused for fused, plain in TE_NORM_NAMES.items()}


def to_dist(config: GPTConfig, weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """``(tensors, extra_state_keys)``: the torch_dist checkpoint's tensor entries, and
    the keys of its ``_extra_state`` objects."""
    if config.moe is not None:
        raise MegatronError(
            "torch_dist export of mixture-of-experts layers is not written yet; "
            "export the legacy format (--format legacy)"
        )
    megatron_args(config)  # refuses what Megatron cannot load, naming it
    per_layer: dict[str, list[Tensor]] = {}
    tensors: dict[str, Tensor] = {}
    for name, tensor in to_megatron_tensors(config, weights).items():
        found = layer_and_rest(name)
        if found is None:
            tensors[name] = tensor
        else:
            rest = _SAVED_NORM_NAMES.get(found[1], found[1])
            per_layer.setdefault(rest, []).append(tensor)
    for rest, layers in per_layer.items():
        tensors[f"decoder.layers.{rest}"] = torch.stack([t.detach() for t in layers])
    layers = config.num_layers
    extra = [
        f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}"
        for linear in _LAYER_LINEARS
        for i in range(layers)
    ]
    return tensors, extra

