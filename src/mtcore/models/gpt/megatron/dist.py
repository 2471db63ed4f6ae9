"""mtcore full weights -> the entries of a torch_dist checkpoint (Megatron-Core's
``dist_checkpointing``), as ``GPTModel.sharded_state_dict()`` names them.

Each tensor is whole: DCP lets every reader take its own shard of it, so one export
loads at any tp x pp. The layers are stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, ...]``) and the norms
have Transformer Engine's names (``self_attention.linear_qkv.layer_norm_weight``), which
Megatron-Core's local layers save under too. Every linear of every layer also has an
``_extra_state`` object (``<name>._extra_state/shard_<layer>_<layers>``; None without
Transformer Engine): a strict load asks for each.

Experts are SequentialMLP's layout (megatron/core/transformer/moe/experts.py,
``SequentialMLP.sharded_state_dict`` without ``singleton_local_shards``): each expert's
linear is the shard ``(layer, expert)`` of ``decoder.layers.mlp.experts.experts.<linear>
.weight`` ``[layers, experts, out, in]``, with one ``_extra_state`` object per layer and
expert (``shard_<layer>.<expert>_<layers>.<experts>``); the router is stacked as any
layer tensor. GroupedMLP and TEGroupedMLP (``--moe-grouped-gemm``) save the same whole
tensors: experts.py says so of each (lines 283-285 and 773, megatron-core 0.16.1).
Only models whose every layer has experts are written: with ``--moe-layer-freq`` > 1
Megatron-Core numbers each layer apart (``non_homogeneous_layers``), a layout not written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.megatron.args import MegatronError, megatron_args
from mtcore.models.gpt.megatron.weights import (
    TE_NORM_NAMES,
    expert_and_rest,
    layer_and_rest,
    to_megatron_tensors,
)

_LAYER_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
_SAVED_NORM_NAMES = {plain: fused for fused, plain in TE_NORM_NAMES.items()}
_EXPERTS = "mlp.experts.experts."  # SequentialMLP's sharded prefix of its local experts


def to_dist(config: GPTConfig, weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """``(tensors, extra_state_keys)``: the torch_dist checkpoint's tensor entries, and
    the keys of its ``_extra_state`` objects."""
    megatron_args(config)  # refuses what Megatron cannot load, naming it
    experts = 0 if config.moe is None else config.moe.num_experts
    if experts and not all(config.is_moe_layer(i) for i in range(config.num_layers)):
        raise MegatronError(
            "torch_dist export of a model mixing dense and expert layers "
            f"(--moe-layer-freq {config.moe_layer_freq}) is not written; "
            "export the legacy format (--format legacy)"
        )
    per_layer: dict[str, list[Tensor]] = {}
    per_expert: dict[str, list[Tensor]] = {}
    tensors: dict[str, Tensor] = {}
    for name, tensor in to_megatron_tensors(config, weights).items():
        found = layer_and_rest(name)
        if found is None:
            tensors[name] = tensor
        elif (expert := expert_and_rest(found[1])) is not None:
            per_expert.setdefault(expert[1], []).append(tensor.detach())  # layer, then expert
        else:
            rest = _SAVED_NORM_NAMES.get(found[1], found[1])
            per_layer.setdefault(rest, []).append(tensor)
    for rest, layers in per_layer.items():
        tensors[f"decoder.layers.{rest}"] = torch.stack([t.detach() for t in layers])
    layers = config.num_layers
    for linear, each in per_expert.items():
        stacked = torch.stack(each).unflatten(0, (layers, experts))
        tensors[f"decoder.layers.{_EXPERTS}{linear}"] = stacked
    linears = _LAYER_LINEARS[:2] if experts else _LAYER_LINEARS
    extra = [
        f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}"
        for linear in linears
        for i in range(layers)
    ]
    extra += [
        f"decoder.layers.{_EXPERTS}{linear}._extra_state/shard_{i}.{e}_{layers}.{experts}"
        for linear in ("linear_fc1", "linear_fc2")
        for i in range(layers)
        for e in range(experts)
    ]
    return tensors, extra

