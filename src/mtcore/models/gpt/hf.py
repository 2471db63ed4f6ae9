"""HuggingFace Llama format <-> mtcore GPT (llama style): config and full weights.

A HuggingFace Llama directory is ``config.json`` (``LlamaForCausalLM``, ``model_type``
"llama") plus ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``).
transformers is not needed to read or write it; only safetensors is.

The two models compute the same function, so the mapping is renaming and (un)fusing:

=======================================  =======================================
mtcore (``GPT(config).state_dict()``)    HuggingFace Llama
=======================================  =======================================
``embed.tok.weight``                     ``model.embed_tokens.weight``
``layers.i.attn_norm.weight``            ``model.layers.i.input_layernorm.weight``
``layers.i.attn.qkv.weight``             ``q_proj | k_proj | v_proj`` (rows)
``layers.i.attn.proj.weight``            ``model.layers.i.self_attn.o_proj.weight``
``layers.i.mlp_norm.weight``             ``model.layers.i.post_attention_layernorm.weight``
``layers.i.mlp.fc1.weight``              ``gate_proj | up_proj`` (rows)
``layers.i.mlp.fc2.weight``              ``model.layers.i.mlp.down_proj.weight``
``norm.weight``                          ``model.norm.weight``
``output.weight`` (untied only)          ``lm_head.weight``
=======================================  =======================================

Both store linear weights ``[out, in]``; both apply RoPE as "rotate half" (the first
half of each head's dims pairs with the second half, ``inv_freq = theta ** (-2i/d)``),
so q and k rows need no permutation; both repeat each kv head for ``heads / kv_heads``
consecutive query heads; both compute RMSNorm as ``x * rsqrt(mean(x^2) + eps) * w``.

Vocabulary: mtcore pads its vocabulary to ``vocab_multiple`` (the padded rows are never
the id of a token). Export keeps them: ``vocab_size`` in config.json is mtcore's padded
size, so logits match exactly and a round trip is lossless; transformers accepts an
embedding larger than the tokenizer (many released Llamas have one). Import keeps the
HF size as it is (no padding: extra rows would change the softmax).

Whatever does not map is refused with an ``HFInteropError`` naming the setting: GPT-2
style pieces (LayerNorm, GELU, learned positions, biases) on export; RoPE scaling,
partial rotary, attention or MLP biases, a head size other than hidden / heads, an
activation other than SiLU, quantized or non-Llama models on import.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError
from torch import Tensor

from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.weights import check_full_weights
from mtcore.models.hf_files import (
    DTYPE_NAMES,
    HFInteropError,
    TensorTaker,
    added_token_ids,
    as_interop_error,
    check_model_type,
    copy_tokenizer,
    need,
    read_config,
    read_safetensors,
    read_tokenizer,
    write_weights_and_config,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Tokens that end a document in common tokenizer.json files (as mtcore's data pipeline).
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


# -- config ----------------------------------------------------------------------------
def llama_config(config: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of ``config`` as a HuggingFace ``LlamaForCausalLM``."""
    _check_exportable(config)
    theta = config.rope_theta
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        # transformers < 5 reads rope_theta; 5 reads rope_parameters.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        # Unknown without a tokenizer (export_llama fills them from one): transformers'
        # defaults (1, 2) would name arbitrary tokens.
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _check_exportable(config: GPTConfig) -> None:
    if config.vocab_size is None:
        raise HFInteropError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    if getattr(config, "moe", None) is not None:
        raise HFInteropError("a mixture-of-experts model (model.moe) cannot be exported as Llama")
    wrong = {
        "norm": (config.norm, "rmsnorm"),
        "activation": (config.activation, "swiglu"),
        "position": (config.position, "rope"),
        "bias": (config.bias, False),
    }
    bad = [f"{k}={v!r} (Llama needs {want!r})" for k, (v, want) in wrong.items() if v != want]
    if bad:
        raise HFInteropError(
            f"a style={config.style!r} model cannot be exported as Llama: " + ", ".join(bad)
        )


def model_config_from_llama(hf: dict, seq_len: int | None = None) -> GPTConfig:
    """The mtcore GPTConfig of a HuggingFace Llama config.json (a dict).

    ``seq_len``: mtcore's sequence length (the RoPE table and the training length);
    None takes ``max_position_embeddings``.
    """
    _check_importable(hf)
    try:
        return GPTConfig(
            style="llama",
            vocab_size=need(hf, "vocab_size"),
            hidden_size=need(hf, "hidden_size"),
            num_layers=need(hf, "num_hidden_layers"),
            num_heads=need(hf, "num_attention_heads"),
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_hidden_size=need(hf, "intermediate_size"),
            seq_len=seq_len or need(hf, "max_position_embeddings"),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range") or 0.02,
        )
    except ValidationError as e:
        raise HFInteropError(f"the Llama config does not make an mtcore model: {e}") from e


def _check_importable(hf: dict) -> None:
    check_model_type(hf, "llama", "Llama", "GPT")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFInteropError(
            f"hidden_act={hf['hidden_act']!r}: mtcore's SwiGLU gates with silu only"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFInteropError(f"{key}=true: mtcore's llama style has no biases")
    heads, hidden = need(hf, "num_attention_heads"), need(hf, "hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise HFInteropError(
            f"head_dim={head_dim} but hidden_size / num_attention_heads = {hidden} / {heads}; "
            "mtcore's head size is hidden_size / num_heads"
        )


def _rope_theta(hf: dict) -> float:
    """RoPE base of a config with plain RoPE; scaled or partial RoPE is refused."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    theta = hf.get("rope_theta")
    for name, rope in (("rope_scaling", scaling), ("rope_parameters", params)):
        if rope is None:
            continue
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise HFInteropError(f"{name}={rope!r}: only one plain RoPE for all layers maps")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise HFInteropError(
                f"{name} has rope_type={kind!r}: mtcore has plain RoPE only (no RoPE scaling)"
            )
        theta = rope.get("rope_theta", theta)
    partial = hf.get("partial_rotary_factor", (params or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFInteropError(f"partial_rotary_factor={partial}: mtcore rotates whole heads")
    return float(theta if theta is not None else 10000.0)


# -- weights ---------------------------------------------------------------------------
_LAYER_NAMES = {  # mtcore name in layer i -> HF name in layer i (one-to-one tensors)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}
_FUSED = {  # mtcore fused weight -> its HF parts, in row order
    "attn.qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _fused_sections(config: GPTConfig, name: str) -> list[int]:
    if name == "attn.qkv.weight":
        q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
        return [q, kv, kv]
    return [config.ffn_size, config.ffn_size]


def to_llama_tensors(config: GPTConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """HuggingFace Llama tensors (names, unfused) from mtcore full weights."""
    _check_exportable(config)
    check_full_weights(config, weights, "the weights to export")
    out = {"model.embed_tokens.weight": weights["embed.tok.weight"]}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER_NAMES.items():
            out[theirs + h] = weights[mine + m]
        for m, parts in _FUSED.items():
            pieces = weights[mine + m].split(_fused_sections(config, m), dim=0)
            out.update({theirs + h: p for h, p in zip(parts, pieces, strict=True)})
    out["model.norm.weight"] = weights["norm.weight"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = weights["output.weight"]
    return out


def from_llama_tensors(config: GPTConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """mtcore full weights (fp32) from HuggingFace Llama tensors; refuses missing,
    unexpected or misshapen tensors, naming them."""
    source = TensorTaker(tensors)
    weights = {"embed.tok.weight": source.take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER_NAMES.items():
            weights[mine + m] = source.take(theirs + h)
        for m, parts in _FUSED.items():
            weights[mine + m] = torch.cat([source.take(theirs + h) for h in parts], dim=0)
    weights["norm.weight"] = source.take("model.norm.weight")
    if not config.tie_embeddings:
        weights["output.weight"] = source.take("lm_head.weight")
    elif "lm_head.weight" in source and not torch.equal(
        source.take("lm_head.weight"), weights["embed.tok.weight"]
    ):
        raise HFInteropError(
            "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
        )
    # Old checkpoints carry the RoPE frequencies as a buffer; mtcore recomputes them.
    source.refuse_untaken("a Llama GPT", ignored_suffix="rotary_emb.inv_freq")
    with as_interop_error():
        check_full_weights(config, weights, "the imported tensors")
    return weights


# -- directories -----------------------------------------------------------------------
def export_llama(
    model_config: GPTConfig,
    full_weights: dict[str, Tensor],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_json: str | Path | None = None,
) -> Path:
    """Write a HuggingFace Llama directory (config.json, model.safetensors and, when
    given, tokenizer.json with a tokenizer_config.json) that
    ``LlamaForCausalLM.from_pretrained`` loads. Returns ``out_dir``."""
    if dtype not in DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
    config = llama_config(model_config, dtype)
    tensors = to_llama_tensors(model_config, full_weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        eos = _eos_token(Path(tokenizer_json))
        settings = {} if eos is None else {"eos_token": eos[0]}
        copy_tokenizer(out, tokenizer_json, model_config.seq_len, **settings)
        if eos is not None:
            config["eos_token_id"] = config["bos_token_id"] = eos[1]
    write_weights_and_config(out, config, tensors, dtype)
    return out


def _eos_token(path: Path) -> tuple[str, int] | None:
    """The end-of-document token of a tokenizer.json and its id, if it has one."""
    ids = added_token_ids(read_tokenizer(path))
    return next(((t, ids[t]) for t in _EOS_CANDIDATES if ids.get(t) is not None), None)


def import_llama(
    hf_dir: str | Path, seq_len: int | None = None
) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The GPTConfig and fp32 full weights (``GPT(config).state_dict()`` names) of a
    HuggingFace Llama directory. ``seq_len`` as in :func:`model_config_from_llama`."""
    directory = Path(hf_dir)
    config = model_config_from_llama(read_config(directory), seq_len)
    return config, from_llama_tensors(config, read_safetensors(directory))

