"""Megatron checkpoints' own arrangements of the tensors <-> whole Megatron tensors.

* torch_dist: every tensor whole, but the layers stacked on a leading axis
  (``decoder.layers.self_attention.linear_qkv.weight`` ``[layers, ...]``; experts
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, ...]``);
  layers built apart (``--moe-layer-freq`` mixes) keep their number in the name.
* legacy: a state dict per tensor (TT), pipeline (PPP) and expert (EEE) rank, and
  per virtual pipeline chunk (``model0``, ``model1`` ...), each with its layers
  numbered from 0 and its experts from 0. Virtual stage ``chunk * pp + stage`` holds
  the next layers in order, so numbering them in that order gives global layers.
"""

from __future__ import annotations

from torch import Tensor

from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.megatron.args import MegatronError, megatron_args
from mtcore.models.gpt.megatron.weights import (
    expert_and_rest,
    from_megatron_tensors,
    layer_and_rest,
    merge_tp_shards,
    split_tp_shards,
    to_megatron_tensors,
)

_STACKED_EXPERTS = "mlp.experts.experts."


def from_dist(config: GPTConfig, stacked: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full weights of a torch_dist checkpoint's model tensors (``_extra_state`` and
    optimizer entries left out by the reader)."""
    return from_megatron_tensors(config, unstack(stacked))


def unstack(stacked: dict[str, Tensor]) -> dict[str, Tensor]:
    """Whole tensors, one per layer (and expert), of torch_dist's stacked ones."""
    tensors = {}
    for key, tensor in stacked.items():
        rest = key.removeprefix("decoder.layers.")
        if rest == key or layer_and_rest(key) is not None:
            tensors[key] = tensor
            continue
        for i, layer in enumerate(tensor.unbind(0)):
            if rest.startswith(_STACKED_EXPERTS):
                linear = rest.removeprefix(_STACKED_EXPERTS)
                for e, expert in enumerate(layer.unbind(0)):
                    tensors[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{linear}"] = expert
            else:
                tensors[f"decoder.layers.{i}.{rest}"] = layer
    return tensors


def from_ranks(
    config: GPTConfig, args: dict, ranks: dict[tuple[int, int, int], list[dict]]
) -> dict[str, Tensor]:
    """Full weights of a legacy checkpoint: ``ranks[(tp, pp, ep)]`` is that rank's list
    of model chunks (one, or one per virtual stage)."""
    tp, pp, ep = (1 + max(key[axis] for key in ranks) for axis in range(3))
    swiglu = bool(args.get("swiglu"))
    tensors: dict[str, Tensor] = {}
    first_layer = 0
    for chunk in range(len(ranks[(0, 0, 0)])):
        for stage in range(pp):
            stage_tensors: dict[str, Tensor] = {}
            for expert_rank in range(ep):
                shards = [ranks[(t, stage, expert_rank)][chunk] for t in range(tp)]
                merged = merge_tp_shards(shards, swiglu)
                stage_tensors.update(_number_experts(merged, expert_rank) if ep > 1 else merged)
            layers = {found[0] for name in stage_tensors if (found := layer_and_rest(name))}
            tensors.update(_renumber(stage_tensors, first_layer))
            first_layer += len(layers)
    return from_megatron_tensors(config, tensors)


def _renumber(tensors: dict[str, Tensor], first_layer: int) -> dict[str, Tensor]:
    out = {}
    for name, tensor in tensors.items():
        found = layer_and_rest(name)
        out[name if found is None else f"decoder.layers.{found[0] + first_layer}.{found[1]}"] = (
            tensor
        )
    return out


def _number_experts(tensors: dict[str, Tensor], expert_rank: int) -> dict[str, Tensor]:
    """An expert rank's local experts numbered globally (each rank holds as many)."""
    numbered = []
    for name in tensors:
        found = layer_and_rest(name)
        expert = expert_and_rest(found[1]) if found else None
        numbered.append((name, found, expert))
    local = 1 + max((expert[0] for _, _, expert in numbered if expert), default=-1)
    out = {}
    for name, found, expert in numbered:
        if expert is None:
            out[name] = tensors[name]
        else:
            index = expert_rank * local + expert[0]
            out[f"decoder.layers.{found[0]}.mlp.experts.local_experts.{index}.{expert[1]}"] = (
                tensors[name]
            )
    return out


def to_ranks(
    config: GPTConfig, weights: dict[str, Tensor], tp: int, pp: int, ep: int = 1
) -> dict[tuple[int, int, int], dict]:
    """``{(tp rank, pp rank, ep rank): state dict}`` of Megatron-Core's ``GPTModel`` at
    ``tp`` x ``pp`` x ``ep`` (layers split evenly, numbered from 0 on each stage; each
    expert rank's experts numbered from 0; ``_extra_state`` entries included, so a
    strict ``load_state_dict`` accepts it)."""
    if config.num_layers % pp:
        raise MegatronError(f"num_layers={config.num_layers} does not split evenly over pp={pp}")
    experts = config.moe.num_experts if config.moe is not None else 1
    if experts % ep:
        raise MegatronError(f"ep={ep} does not divide the {experts} expert(s)")
    megatron_args(config, tp, pp)  # refuses what Megatron cannot load, naming it
    whole = to_megatron_tensors(config, weights)
    per_stage = config.num_layers // pp
    out = {}
    for stage in range(pp):
        stage_tensors = {}
        for name, tensor in whole.items():
            found = layer_and_rest(name)
            if found is None:
                if _on_stage(name, stage, pp):
                    stage_tensors[name] = tensor
            elif stage * per_stage <= found[0] < (stage + 1) * per_stage:
                stage_tensors[f"decoder.layers.{found[0] - stage * per_stage}.{found[1]}"] = tensor
        if config.tie_embeddings and pp > 1 and stage == pp - 1:  # the last stage's copy
            stage_tensors["output_layer.weight"] = whole["embedding.word_embeddings.weight"]
        swiglu = config.activation == "swiglu"
        for rank, shard in enumerate(split_tp_shards(stage_tensors, tp, swiglu)):
            for expert_rank in range(ep):
                local = _local_experts(shard, expert_rank, experts // ep)
                out[(rank, stage, expert_rank)] = _with_extra_state(local, last=stage == pp - 1)
    return out


def _local_experts(tensors: dict[str, Tensor], expert_rank: int, local: int) -> dict[str, Tensor]:
    """An expert rank's share: its ``local`` experts, numbered from 0, and the rest."""
    out = {}
    for name, tensor in tensors.items():
        found = layer_and_rest(name)
        expert = expert_and_rest(found[1]) if found else None
        if expert is None:
            out[name] = tensor
        elif expert_rank * local <= expert[0] < (expert_rank + 1) * local:
            index = expert[0] - expert_rank * local
            out[f"decoder.layers.{found[0]}.mlp.experts.local_experts.{index}.{expert[1]}"] = tensor
    return out


def _on_stage(name: str, stage: int, pp: int) -> bool:
    if name.startswith("embedding."):
        return stage == 0
    if name.startswith("decoder.final_layernorm") or name == "output_layer.weight":
        return stage == pp - 1
    return True


def _with_extra_state(shard: dict[str, Tensor], last: bool) -> dict:
    """Megatron-Core's linear layers (the output layer too, weight or not: a tied one
    has none) save an ``_extra_state`` entry, None without Transformer Engine."""
    model = dict(shard)
    for name in shard:
        if name.endswith(".weight") and "linear_" in name:
            model[name.removesuffix("weight") + "_extra_state"] = None
    if last:
        model["output_layer._extra_state"] = None
    return model
