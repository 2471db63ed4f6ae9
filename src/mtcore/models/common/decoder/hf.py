"""HuggingFace Llama / Mistral / Qwen2 / Mixtral / DeepSeek-V2/V3 format <-> mtcore GPT (llama style).

A HuggingFace directory is ``config.json`` plus ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``). transformers is not needed to read or write it;
only safetensors is. Which architecture a config is, and what each adds to Llama, is
``hf_config``; the tensors are the same for all four but for the MLP of Mixtral and
the q/k/v biases of Qwen2, so the mapping is renaming and (un)fusing:

=======================================  =======================================
mtcore (``GPT(config).state_dict()``)    HuggingFace
=======================================  =======================================
``embed.tok.weight``                     ``model.embed_tokens.weight``
``layers.i.attn_norm.weight``            ``model.layers.i.input_layernorm.weight``
``layers.i.attn.qkv.weight`` (``bias``)  ``q_proj | k_proj | v_proj`` (rows)
``layers.i.attn.proj.weight``            ``model.layers.i.self_attn.o_proj.weight``
``layers.i.mlp_norm.weight``             ``model.layers.i.post_attention_layernorm.weight``
``layers.i.mlp.fc1.weight``              ``gate_proj | up_proj`` (rows)
``layers.i.mlp.fc2.weight``              ``model.layers.i.mlp.down_proj.weight``
``layers.i.mlp.router.weight``           ``block_sparse_moe.gate.weight`` (Mixtral)
``layers.i.mlp.experts.fc1[e]``          ``experts.e.w1 | experts.e.w3``, transposed
``layers.i.mlp.experts.fc2[e]``          ``experts.e.w2``, transposed
``norm.weight``                          ``model.norm.weight``
``output.weight`` (untied only)          ``lm_head.weight``
=======================================  =======================================

DeepSeek-V2's and -V3's latent attention and experts map as ``hf_deepseek`` says.

Both store linear weights ``[out, in]`` (mtcore's experts are ``[in, out]``, for the
grouped matmul); both apply RoPE as "rotate half", so q and k rows need no
permutation; both repeat each kv head for ``heads / kv_heads`` consecutive query heads.

Vocabulary: export keeps mtcore's padded vocabulary (logits match exactly, the round
trip is lossless); import keeps the HF size as it is (extra rows would change the
softmax). Whatever does not map is refused with an ``HFInteropError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.decoder.hf_config import (
    MODEL_TYPES,
    check_exportable,
    default_architecture,
    hf_config,
    model_config_from_hf,
)
from mtcore.models.common.decoder.hf_deepseek import (
    gated_experts_from_hf,
    gated_experts_to_hf,
    latent_attention_from_hf,
    latent_attention_to_hf,
)
from mtcore.models.common.decoder.weights import check_full_weights
from mtcore.models.common.hf_files import (
    DTYPE_NAMES,
    HFInteropError,
    TensorTaker,
    as_interop_error,
    begin_of_sequence_token,
    copy_tokenizer,
    end_of_document_token,
    read_config,
    read_safetensors,
    write_weights_and_config,
)

__all__ = [
    "DTYPES",
    "MODEL_TYPES",
    "HFInteropError",
    "default_architecture",
    "end_of_document_token",
    "export_hf",
    "from_hf_tensors",
    "from_llama_tensors",
    "hf_config",
    "import_hf",
    "llama_config",
    "to_hf_tensors",
    "to_llama_tensors",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def llama_config(config: DecoderConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of ``config`` as its default architecture (Llama for a dense
    model without q/k/v biases or a window)."""
    return hf_config(config, None, dtype)


# -- weights ---------------------------------------------------------------------------
_LAYER_NAMES = {  # mtcore name in layer i -> HF name in layer i (one-to-one tensors)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_DENSE = {"mlp.fc2.weight": "mlp.down_proj.weight"}
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_MOE = "block_sparse_moe"
_QK_NORM = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
# experts.e.gate_proj / up_proj / down_proj
_GATED_EXPERTS = ("deepseek_v2", "deepseek_v3", "qwen3_moe")


def _qkv_sections(config: DecoderConfig) -> list[int]:
    q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
    return [q, kv, kv]


def to_hf_tensors(
    config: DecoderConfig, weights: dict[str, Tensor], architecture: str | None = None
) -> dict[str, Tensor]:
    """HuggingFace tensors (names, unfused) of mtcore full weights as ``architecture``."""
    architecture = architecture or default_architecture(config)
    check_exportable(config, architecture)
    check_full_weights(config, weights, "the weights to export")
    out = {"model.embed_tokens.weight": weights["embed.tok.weight"]}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER_NAMES.items():
            out[theirs + h] = weights[mine + m]
        if config.mla is not None:
            out.update(latent_attention_to_hf(config, weights, mine, theirs))
        else:
            qkv = weights[mine + "attn.qkv.weight"].split(_qkv_sections(config))
            out.update({f"{theirs}{h}.weight": t for h, t in zip(_QKV, qkv, strict=True)})
        if config.qk_norm:
            out.update({f"{theirs}{h}": weights[mine + m] for m, h in _QK_NORM.items()})
        if architecture == "qwen2":  # Qwen2 always has them: zeros add nothing
            bias = weights.get(mine + "attn.qkv.bias")
            if bias is None:
                bias = torch.zeros(sum(_qkv_sections(config)))
            parts = bias.split(_qkv_sections(config))
            out.update({f"{theirs}{h}.bias": t for h, t in zip(_QKV, parts, strict=True)})
        if config.is_moe_layer(i) and architecture in _GATED_EXPERTS:
            bias = architecture == "deepseek_v3"
            out.update(gated_experts_to_hf(config, weights, mine + "mlp.", theirs, bias))
            continue
        if config.is_moe_layer(i):
            out.update(_experts_to_hf(config, weights, mine + "mlp.", f"{theirs}{_MOE}."))
            continue
        out[theirs + _DENSE["mlp.fc2.weight"]] = weights[mine + "mlp.fc2.weight"]
        gate, up = weights[mine + "mlp.fc1.weight"].split(config.ffn_size)
        out.update({theirs + _GATE_UP[0]: gate, theirs + _GATE_UP[1]: up})
    out["model.norm.weight"] = weights["norm.weight"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = weights["output.weight"]
    return out


def _experts_to_hf(config: DecoderConfig, weights, mine: str, theirs: str) -> dict[str, Tensor]:
    bias = weights[mine + "router.expert_bias"]
    if bias.abs().max() > 0:
        raise HFInteropError(
            f"{mine}router.expert_bias is nonzero (aux-loss-free balancing): Mixtral's router "
            "has no expert bias"
        )
    f = config.moe.ffn_size
    out = {theirs + "gate.weight": weights[mine + "router.weight"]}
    fc1, fc2 = weights[mine + "experts.fc1"], weights[mine + "experts.fc2"]
    for e in range(config.moe.num_experts):
        out[f"{theirs}experts.{e}.w1.weight"] = fc1[e, :, :f].t()
        out[f"{theirs}experts.{e}.w3.weight"] = fc1[e, :, f:].t()
        out[f"{theirs}experts.{e}.w2.weight"] = fc2[e].t()
    return out


def from_hf_tensors(
    config: DecoderConfig, tensors: dict[str, Tensor], architecture: str | None = None,
    mtp_layers: int = 0,
) -> dict[str, Tensor]:  # fmt: skip
    """mtcore full weights (fp32) from HuggingFace tensors of ``architecture`` (None:
    ``default_architecture``); refuses missing, unexpected or misshapen tensors, naming
    them. ``mtp_layers``: the multi-token-prediction layers after the last layer that
    the config declares (DeepSeek's ``num_nextn_predict_layers``), skipped; a tensor of
    any other layer past the last is refused like any unexpected tensor."""
    architecture = architecture or default_architecture(config)
    source = TensorTaker(tensors)
    weights = {"embed.tok.weight": source.take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER_NAMES.items():
            weights[mine + m] = source.take(theirs + h)
        if config.mla is not None:
            weights.update(latent_attention_from_hf(config, source, mine, theirs))
        else:
            weights[mine + "attn.qkv.weight"] = torch.cat(
                [source.take(f"{theirs}{h}.weight") for h in _QKV]
            )
        if config.qk_norm:
            weights.update({mine + m: source.take(theirs + h) for m, h in _QK_NORM.items()})
        if config.qkv_bias:
            weights[mine + "attn.qkv.bias"] = torch.cat(
                [source.take(f"{theirs}{h}.bias") for h in _QKV]
            )
        if config.is_moe_layer(i) and architecture in _GATED_EXPERTS:
            bias = architecture == "deepseek_v3"
            weights.update(gated_experts_from_hf(config, source, mine + "mlp.", theirs, bias))
            continue
        if config.is_moe_layer(i):
            weights.update(_experts_from_hf(config, source, mine + "mlp.", f"{theirs}{_MOE}."))
            continue
        weights[mine + "mlp.fc2.weight"] = source.take(theirs + _DENSE["mlp.fc2.weight"])
        weights[mine + "mlp.fc1.weight"] = torch.cat([source.take(theirs + h) for h in _GATE_UP])
    weights["norm.weight"] = source.take("model.norm.weight")
    if not config.tie_embeddings:
        weights["output.weight"] = source.take("lm_head.weight")
    elif "lm_head.weight" in source and not torch.equal(
        source.take("lm_head.weight"), weights["embed.tok.weight"]
    ):
        raise HFInteropError(
            "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
        )
    # DeepSeek's multi-token-prediction layers follow the last layer; they are not loaded.
    for name in list(source.tensors):
        if config.num_layers <= _layer_index(name) < config.num_layers + mtp_layers:
            source.used.add(name)
    past = sorted({_layer_index(n) for n in set(source.tensors) - source.used} - {-1})
    past = [layer for layer in past if layer >= config.num_layers]
    if past:
        declared = f"{config.num_layers} layers (num_hidden_layers)"
        declared += f" and {mtp_layers} num_nextn_predict_layers" if mtp_layers else ""
        raise HFInteropError(
            f"the tensors hold layer(s) {', '.join(map(str, past[:5]))} past the {declared} "
            "the config declares: refusing to drop them"
        )
    # Old checkpoints carry the RoPE frequencies as a buffer; mtcore recomputes them.
    source.refuse_untaken("a llama-style GPT", ignored_suffix="rotary_emb.inv_freq")
    with as_interop_error():
        check_full_weights(config, weights, "the imported tensors")
    return weights


def _layer_index(name: str) -> int:
    """The layer of ``model.layers.<i>.…`` (-1 for other names)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2])
    return -1


def _experts_from_hf(config: DecoderConfig, source: TensorTaker, mine: str, theirs: str) -> dict:
    m = config.moe
    experts = range(m.num_experts)

    def stack(w: str) -> Tensor:
        return torch.stack([source.take(f"{theirs}experts.{e}.{w}.weight").t() for e in experts])

    return {
        mine + "router.weight": source.take(theirs + "gate.weight"),
        mine + "router.expert_bias": torch.zeros(m.num_experts),
        mine + "experts.fc1": torch.cat([stack("w1"), stack("w3")], dim=2),
        mine + "experts.fc2": stack("w2"),
    }


to_llama_tensors, from_llama_tensors = to_hf_tensors, from_hf_tensors  # the older names


# -- directories -----------------------------------------------------------------------
def export_hf(
    model_config: DecoderConfig,
    full_weights: dict[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_json: str | Path | None = None,
    architecture: str | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a HuggingFace directory that ``<Architecture>ForCausalLM.from_pretrained``
    loads: config.json, the weights (one ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with an index; None: 5 GB) and, when
    given, tokenizer.json with a tokenizer_config.json. ``architecture``: a model_type
    of ``MODEL_TYPES`` (None: the one that holds the model). Returns ``out_dir``."""
    if dtype not in DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
    config = hf_config(model_config, architecture, dtype)
    tensors = to_hf_tensors(model_config, full_weights, architecture)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        # mtcore's data pipeline ends (and so starts) each document with one token, and
        # pads with nothing of its own: that token is eos and pad, and bos too unless the
        # tokenizer has its own (Llama 3's <|begin_of_text|>, Llama 2's <s>).
        eod = end_of_document_token(Path(tokenizer_json))
        bos = begin_of_sequence_token(Path(tokenizer_json)) or eod
        roles = {"bos": bos, "eos": eod, "pad": eod}
        settings = {f"{role}_token": token[0] for role, token in roles.items() if token}
        # A special token's text in the input is text, as in mtcore's tokenizer: both
        # give the same ids for any string (docs/hf-interop.md, "Special tokens").
        settings["split_special_tokens"] = True
        copy_tokenizer(out, tokenizer_json, model_config.seq_len, **settings)
        config.update({f"{role}_token_id": token[1] for role, token in roles.items() if token})
    write_weights_and_config(out, config, tensors, dtype, max_shard_bytes)
    return out


def import_hf(
    hf_dir: str | Path, seq_len: int | None, config_class: Callable[..., DecoderConfig]
) -> tuple[DecoderConfig, dict[str, Tensor]]:
    """The config (a ``config_class``) and fp32 full weights (``GPT(config).state_dict()``
    names) of a HuggingFace Llama, Mistral, Qwen2 or Mixtral directory (one file or
    shards). ``seq_len`` as in ``hf_config.model_config_from_hf``."""
    directory = Path(hf_dir)
    hf = read_config(directory)
    config = model_config_from_hf(hf, seq_len, config_class)
    mtp_layers = hf.get("num_nextn_predict_layers") or 0
    if type(mtp_layers) is not int or mtp_layers < 0:
        raise HFInteropError(
            f"{directory / 'config.json'}: num_nextn_predict_layers is {mtp_layers!r}, not a "
            "whole number >= 0"
        )
    tensors = read_safetensors(directory)
    return config, from_hf_tensors(config, tensors, hf["model_type"], mtp_layers)
