"""Megatron-Core GPT tensors <-> mtcore full weights.

"Whole Megatron tensors" are Megatron-Core's ``GPTModel`` state-dict names with global
layer numbers and global expert numbers, each tensor unsplit over tensor parallelism:
what a torch_dist checkpoint stores (once its layer and expert axes are unstacked), or
what ``merge_tp_shards`` makes of one pipeline stage's per-rank state dicts.

=====================================================  ==================================
Megatron-Core (layer ``i``: ``decoder.layers.i.``)      mtcore
=====================================================  ==================================
``embedding.word_embeddings.weight`` (vocab padded)     ``embed.tok.weight``
``embedding.position_embeddings.weight``                ``embed.pos``
``input_layernorm.{weight,bias}``                       ``layers.i.attn_norm.*``
``self_attention.linear_qkv.{weight,bias}``             ``layers.i.attn.qkv.*`` (rows regrouped)
``self_attention.linear_proj.{weight,bias}``            ``layers.i.attn.proj.*``
``pre_mlp_layernorm.{weight,bias}``                     ``layers.i.mlp_norm.*``
``mlp.linear_fc1``, ``mlp.linear_fc2``                  ``layers.i.mlp.fc1``, ``mlp.fc2``
``mlp.router.weight``                                   ``layers.i.mlp.router.weight``
``mlp.experts.local_experts.e.linear_fc1.weight``       ``layers.i.mlp.experts.fc1[e]``, [in, out]
``decoder.final_layernorm.*``                           ``norm.*``
``output_layer.weight`` (untied)                        ``output.weight``
=====================================================  ==================================

Megatron's fused ``linear_qkv`` holds, for each query group in turn, the group's query
heads, then its key head, then its value head; mtcore's ``qkv`` holds all queries, all
keys, all values. Under tensor parallelism each rank holds whole groups, so the whole
tensor is the ranks' rows in order. SwiGLU's ``linear_fc1`` is ``[gate; up]`` on each
rank, so the whole tensor is every rank's gate rows, then every rank's up rows.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from mtcore.models.common.decoder.weights import check_full_weights
from mtcore.models.common.hf_files import TensorTaker
from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.megatron.args import MegatronError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# Transformer Engine's layers fuse the norm into the next linear; same tensor, other name.
TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight")  # fmt: skip
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_NORMS = {"input_layernorm": "attn_norm", "pre_mlp_layernorm": "mlp_norm"}
_LINEARS = {
    "self_attention.linear_qkv": "attn.qkv",
    "self_attention.linear_proj": "attn.proj",
    "mlp.linear_fc1": "mlp.fc1",
    "mlp.linear_fc2": "mlp.fc2",
}


def canonical_name(name: str) -> str:
    """A Megatron state-dict name with Transformer Engine's fused-norm names as the
    plain ones (``input_layernorm``, ``pre_mlp_layernorm``)."""
    match = _LAYER.match(name)
    if match and match.group(2) in TE_NORM_NAMES:
        return f"decoder.layers.{match.group(1)}.{TE_NORM_NAMES[match.group(2)]}"
    return name


def _split_dim(name: str) -> int | None:
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def merge_tp_shards(shards: list[dict[str, Tensor]], swiglu: bool) -> dict[str, Tensor]:
    """One pipeline stage's tensor-parallel state dicts (rank 0 first) as whole tensors:
    column-parallel tensors joined by rows (SwiGLU's ``linear_fc1`` gate rows then up
    rows), row-parallel ones by columns, the rest taken from rank 0. ``_extra_state``
    entries (Transformer Engine's FP8 metadata) are dropped."""
    whole = {}
    for name, first in shards[0].items():
        if name.endswith("_extra_state") or not isinstance(first, Tensor):
            continue
        parts = [shard[name] for shard in shards]
        dim = _split_dim(name)
        if dim is None or len(parts) == 1:
            whole[name] = first
        elif swiglu and "linear_fc1" in name:
            halves = [part.chunk(2, dim=0) for part in parts]
            whole[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            whole[name] = torch.cat(parts, dim=dim)
    return whole


def split_tp_shards(whole: dict[str, Tensor], tp: int, swiglu: bool) -> list[dict[str, Tensor]]:
    """``merge_tp_shards`` undone: the state dict of each tensor-parallel rank."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, tensor in whole.items():
        dim = _split_dim(name)
        if dim is None:
            parts = [tensor] * tp
        elif swiglu and "linear_fc1" in name:
            gate, up = tensor.chunk(2, dim=0)
            parts = [torch.cat(p) for p in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        else:
            if tensor.shape[dim] % tp:
                raise MegatronError(f"{name} {tuple(tensor.shape)} does not split over tp={tp}")
            parts = list(tensor.chunk(tp, dim=dim))
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part.clone()
    return shards


def _qkv_order(config: GPTConfig) -> Tensor:
    """Megatron row ``order[j]`` of mtcore's ``qkv`` row ``j``."""
    d, groups = config.head_dim, config.kv_heads
    per_group = config.num_heads // groups
    rows = torch.arange((config.num_heads + 2 * groups) * d).view(groups, per_group + 2, d)
    q = rows[:, :per_group].reshape(-1)
    k, v = rows[:, per_group].reshape(-1), rows[:, per_group + 1].reshape(-1)
    return torch.cat([q, k, v])


def from_megatron_tensors(config: GPTConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """mtcore full weights (fp32) from whole Megatron tensors; refuses missing,
    unexpected or misshapen tensors, naming them."""
    source = TensorTaker(
        {canonical_name(k): v.float() for k, v in tensors.items()}, "the Megatron tensors"
    )
    weights = {"embed.tok.weight": source.take("embedding.word_embeddings.weight")}
    if config.position == "learned":
        weights["embed.pos"] = source.take("embedding.position_embeddings.weight")
    order = _qkv_order(config)
    for i in range(config.num_layers):
        theirs, mine = f"decoder.layers.{i}.", f"layers.{i}."
        for norm, ours in _NORMS.items():
            for part in _norm_parts(config):
                weights[f"{mine}{ours}.{part}"] = source.take(f"{theirs}{norm}.{part}")
        linears = dict(_LINEARS) if not config.is_moe_layer(i) else dict(list(_LINEARS.items())[:2])
        for megatron_name, ours in linears.items():
            for part in ("weight", "bias"):
                name = f"{theirs}{megatron_name}.{part}"
                if part == "bias" and name not in source:
                    continue
                tensor = source.take(name)
                weights[f"{mine}{ours}.{part}"] = tensor[order] if ours == "attn.qkv" else tensor
        if config.is_moe_layer(i):
            weights.update(_experts_from_megatron(config, source, theirs + "mlp.", mine + "mlp."))
    for part in _norm_parts(config):
        weights[f"norm.{part}"] = source.take(f"decoder.final_layernorm.{part}")
    if not config.tie_embeddings:
        weights["output.weight"] = source.take("output_layer.weight")
    elif "output_layer.weight" in source:
        source.take("output_layer.weight")  # the last stage's copy of the tied embedding
    source.refuse_untaken("a Megatron-Core GPT", ignored_suffix="_extra_state")
    try:
        check_full_weights(config, weights, "the Megatron tensors")
    except ValueError as e:
        raise MegatronError(str(e)) from None
    return weights


def _norm_parts(config: GPTConfig) -> tuple[str, ...]:
    return ("weight",) if config.norm == "rmsnorm" else ("weight", "bias")


def _experts_from_megatron(config: GPTConfig, source: TensorTaker, theirs: str, mine: str) -> dict:
    experts = range(config.moe.num_experts)

    def stack(linear: str) -> Tensor:
        return torch.stack(
            [source.take(f"{theirs}experts.local_experts.{e}.{linear}.weight").t() for e in experts]
        )

    return {
        mine + "router.weight": source.take(theirs + "router.weight"),
        mine + "router.expert_bias": torch.zeros(config.moe.num_experts),
        mine + "experts.fc1": stack("linear_fc1"),
        mine + "experts.fc2": stack("linear_fc2"),
    }


def to_megatron_tensors(config: GPTConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Whole Megatron tensors of mtcore full weights (``from_megatron_tensors`` undone)."""
    check_full_weights(config, weights, "the weights to export")
    out = {"embedding.word_embeddings.weight": weights["embed.tok.weight"]}
    if config.position == "learned":
        out["embedding.position_embeddings.weight"] = weights["embed.pos"]
    inverse = torch.argsort(_qkv_order(config))
    for i in range(config.num_layers):
        theirs, mine = f"decoder.layers.{i}.", f"layers.{i}."
        for norm, ours in _NORMS.items():
            for part in _norm_parts(config):
                out[f"{theirs}{norm}.{part}"] = weights[f"{mine}{ours}.{part}"]
        for megatron_name, ours in _LINEARS.items():
            for part in ("weight", "bias"):
                tensor = weights.get(f"{mine}{ours}.{part}")
                if tensor is not None:
                    out[f"{theirs}{megatron_name}.{part}"] = (
                        tensor[inverse] if ours == "attn.qkv" else tensor
                    )
        if config.is_moe_layer(i):
            if weights[mine + "mlp.router.expert_bias"].abs().max() > 0:
                raise MegatronError(f"{mine}mlp.router.expert_bias is nonzero: not exported")
            out[theirs + "mlp.router.weight"] = weights[mine + "mlp.router.weight"]
            for e in range(config.moe.num_experts):
                for linear in ("fc1", "fc2"):
                    expert = weights[f"{mine}mlp.experts.{linear}"][e].t().contiguous()
                    out[f"{theirs}mlp.experts.local_experts.{e}.linear_{linear}.weight"] = expert
    for part in _norm_parts(config):
        out[f"decoder.final_layernorm.{part}"] = weights[f"norm.{part}"]
    if not config.tie_embeddings:
        out["output_layer.weight"] = weights["output.weight"]
    return out


def layer_and_rest(name: str) -> tuple[int, str] | None:
    """``(i, rest)`` of ``decoder.layers.i.rest``; None for a name outside the layers."""
    match = _LAYER.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def expert_and_rest(rest: str) -> tuple[int, str] | None:
    """``(e, linear)`` of a layer's ``mlp.experts.local_experts.e.linear``."""
    match = _EXPERT.match(rest)
    return None if match is None else (int(match.group(1)), match.group(2))
