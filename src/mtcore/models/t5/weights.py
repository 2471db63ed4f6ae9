"""Full (unsharded, one-process) T5 weights: their names and shapes, loading them into any
layout, and the one-to-one map to HuggingFace's ``T5ForConditionalGeneration`` names.

"Full weights" are the tensors of ``T5(config).state_dict()``: whole, named as in one
process, without a last stage's copy of a tied embedding. They are what checkpoints,
HuggingFace import/export and every layout exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from mtcore.models.common.full_weights import check_weight_shapes, load_chunk_weights
from mtcore.models.t5.config import T5Config
from mtcore.models.t5.names import EMBEDDING, LM_HEAD


def full_weight_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``T5(config).state_dict()`` (vocab_size set)."""
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    h, f, v = config.hidden_size, config.ffn_size, config.vocab_size
    inner, buckets = config.num_heads * config.kv_dim, (config.relative_buckets, config.num_heads)
    attention = {
        "attn_norm.weight": (h,),
        "attn.qkv.weight": (3 * inner, h),
        "attn.out.weight": (h, inner),
    }
    ffn = {"mlp_norm.weight": (h,), "mlp.wi.weight": (2 * f, h), "mlp.wo.weight": (h, f)}
    cross = {
        "cross_norm.weight": (h,),
        "cross.q.weight": (inner, h),
        "cross.kv.weight": (2 * inner, h),
        "cross.out.weight": (h, inner),
    }
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (v, h)}
    for i in range(config.num_layers):
        parts = {**attention, **ffn} if i < config.encoder_layers else {**attention, **cross, **ffn}
        shapes.update({f"layers.{i}.{name}": shape for name, shape in parts.items()})
    shapes.update(
        {"encoder_bias.weight": buckets, "encoder_norm.weight": (h,)}
        | {"decoder_bias.weight": buckets, "decoder_norm.weight": (h,)}
    )
    if not config.tie_embeddings:
        shapes[LM_HEAD] = (v, h)
    return shapes


def check_full_weights(config: T5Config, weights: Mapping[str, Tensor], what: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor of ``weights``."""
    check_weight_shapes(full_weight_shapes(config), weights, what)


def load_full_weights(chunks: Iterable, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of the full ``weights`` into each of its chunks (``build``'s
    chunks, or ``[T5(config)]``); a tied head copy gets the embedding. No communication."""
    for chunk in chunks:
        source = dict(weights)
        if chunk.head_is_copy:
            source[LM_HEAD] = weights[EMBEDDING]
        load_chunk_weights(chunk, source)


# -- HuggingFace names -------------------------------------------------------------------
def _hf_layer_names(config: T5Config, i: int) -> dict[str, list[str]]:
    """mtcore name -> the HF tensors it fuses (in order), for layer ``i`` of the stack."""
    decoder = i >= config.encoder_layers
    stack, j = ("decoder", i - config.encoder_layers) if decoder else ("encoder", i)
    block = f"{stack}.block.{j}.layer"
    ffn = 2 if decoder else 1
    names = {
        "attn_norm.weight": [f"{block}.0.layer_norm.weight"],
        "attn.qkv.weight": [f"{block}.0.SelfAttention.{p}.weight" for p in "qkv"],
        "attn.out.weight": [f"{block}.0.SelfAttention.o.weight"],
        "mlp_norm.weight": [f"{block}.{ffn}.layer_norm.weight"],
        "mlp.wi.weight": [f"{block}.{ffn}.DenseReluDense.wi_{k}.weight" for k in (0, 1)],
        "mlp.wo.weight": [f"{block}.{ffn}.DenseReluDense.wo.weight"],
    }
    if decoder:
        names |= {
            "cross_norm.weight": [f"{block}.1.layer_norm.weight"],
            "cross.q.weight": [f"{block}.1.EncDecAttention.q.weight"],
            "cross.kv.weight": [f"{block}.1.EncDecAttention.{p}.weight" for p in "kv"],
            "cross.out.weight": [f"{block}.1.EncDecAttention.o.weight"],
        }
    return {f"layers.{i}.{mine}": theirs for mine, theirs in names.items()}


def hf_names(config: T5Config) -> dict[str, list[str]]:
    """Every full-weight name -> the HF ``T5ForConditionalGeneration`` tensors it holds
    (several for a fused weight, concatenated along dim 0 in this order)."""
    rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    names = {EMBEDDING: ["shared.weight"]}
    for i in range(config.num_layers):
        names.update(_hf_layer_names(config, i))
    names |= {
        "encoder_bias.weight": [f"encoder.{rel}"],
        "encoder_norm.weight": ["encoder.final_layer_norm.weight"],
        "decoder_bias.weight": [f"decoder.{rel}"],
        "decoder_norm.weight": ["decoder.final_layer_norm.weight"],
    }
    if not config.tie_embeddings:
        names[LM_HEAD] = ["lm_head.weight"]
    return names


def to_hf_tensors(config: T5Config, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HuggingFace tensors (q/k/v and wi_0/wi_1 unfused) from mtcore full weights."""
    check_full_weights(config, weights, "the weights to export")
    out = {}
    for mine, theirs in hf_names(config).items():
        parts = weights[mine].chunk(len(theirs), dim=0)
        out.update({name: part.contiguous() for name, part in zip(theirs, parts, strict=True)})
    return out


def from_hf_tensors(config: T5Config, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """mtcore full weights (fp32) from HuggingFace tensors; ValueError names a missing one."""
    names = hf_names(config)
    missing = [t for theirs in names.values() for t in theirs if t not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"the HuggingFace T5 weights lack {', '.join(missing[:3])}{more}")
    weights = {
        mine: torch.cat([tensors[t].to(torch.float32) for t in theirs], dim=0)
        for mine, theirs in names.items()
    }
    check_full_weights(config, weights, "the imported weights")
    return weights
