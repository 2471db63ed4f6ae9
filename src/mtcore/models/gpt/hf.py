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

import json
import os
import shutil
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.weights import check_full_weights

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Tokens that end a document in common tokenizer.json files (as mtcore's data pipeline).
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class HFInteropError(ValueError):
    """A model, config or file that cannot map between mtcore and HuggingFace Llama."""


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
        "torch_dtype": _DTYPE_NAMES[dtype],
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
            vocab_size=_need(hf, "vocab_size"),
            hidden_size=_need(hf, "hidden_size"),
            num_layers=_need(hf, "num_hidden_layers"),
            num_heads=_need(hf, "num_attention_heads"),
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_hidden_size=_need(hf, "intermediate_size"),
            seq_len=seq_len or _need(hf, "max_position_embeddings"),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range") or 0.02,
        )
    except ValidationError as e:
        raise HFInteropError(f"the Llama config does not make an mtcore model: {e}") from e


def _need(hf: dict, key: str):
    if hf.get(key) is None:
        raise HFInteropError(f"config.json lacks {key!r}")
    return hf[key]


def _check_importable(hf: dict) -> None:
    if hf.get("model_type") != "llama":
        raise HFInteropError(
            f"model_type={hf.get('model_type')!r}: only HuggingFace Llama (model_type 'llama') "
            "maps onto mtcore's GPT"
        )
    if hf.get("quantization_config"):
        raise HFInteropError("quantized checkpoints (quantization_config) cannot be imported")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFInteropError(
            f"hidden_act={hf['hidden_act']!r}: mtcore's SwiGLU gates with silu only"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFInteropError(f"{key}=true: mtcore's llama style has no biases")
    heads, hidden = _need(hf, "num_attention_heads"), _need(hf, "hidden_size")
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
    # Old checkpoints carry the RoPE frequencies as a buffer; mtcore recomputes them.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()

    def take(name: str) -> Tensor:
        if name not in tensors:
            raise HFInteropError(f"the safetensors files lack {name!r}")
        used.add(name)
        return tensors[name].float()

    weights = {"embed.tok.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _LAYER_NAMES.items():
            weights[mine + m] = take(theirs + h)
        for m, parts in _FUSED.items():
            weights[mine + m] = torch.cat([take(theirs + h) for h in parts], dim=0)
    weights["norm.weight"] = take("model.norm.weight")
    if not config.tie_embeddings:
        weights["output.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in tensors and not torch.equal(
        take("lm_head.weight"), weights["embed.tok.weight"]
    ):
        raise HFInteropError(
            "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
        )
    extra = sorted(set(tensors) - used)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise HFInteropError(f"tensors with no place in a Llama GPT: {', '.join(extra[:5])}{more}")
    try:
        check_full_weights(config, weights, "the imported tensors")
    except ValueError as e:
        raise HFInteropError(str(e)) from e
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
    if dtype not in _DTYPE_NAMES:
        raise HFInteropError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
    config = llama_config(model_config, dtype)
    # clone(): safetensors refuses tensors that share storage (the split views do).
    tensors = {
        k: v.detach().to("cpu", dtype).clone()
        for k, v in to_llama_tensors(model_config, full_weights).items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is not None:
        eos = _eos_token(Path(tokenizer_json))
        shutil.copyfile(tokenizer_json, out / TOKENIZER)
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        tok_config["model_max_length"] = model_config.seq_len
        if eos is not None:
            tok_config["eos_token"] = eos[0]
            config["eos_token_id"] = config["bos_token_id"] = eos[1]
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    _readable_like_other_files(out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _readable_like_other_files(path: Path) -> None:
    """safetensors writes its file owner-only (0600); give it the mode ``open()`` would
    (0666 less the umask), so a shared export is readable like its config.json."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _eos_token(path: Path) -> tuple[str, int] | None:
    """The end-of-document token of a tokenizer.json and its id, if it has one."""
    try:
        added = json.loads(path.read_text()).get("added_tokens") or []
    except (OSError, json.JSONDecodeError) as e:
        raise HFInteropError(f"cannot read tokenizer {path}: {e}") from e
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    return next(((t, ids[t]) for t in _EOS_CANDIDATES if ids.get(t) is not None), None)


def import_llama(
    hf_dir: str | Path, seq_len: int | None = None
) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The GPTConfig and fp32 full weights (``GPT(config).state_dict()`` names) of a
    HuggingFace Llama directory. ``seq_len`` as in :func:`model_config_from_llama`."""
    directory = Path(hf_dir)
    if not (directory / CONFIG).is_file():
        raise HFInteropError(f"no HuggingFace model at {directory} (expected {directory / CONFIG})")
    try:
        hf = json.loads((directory / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise HFInteropError(f"{directory / CONFIG} is not valid JSON: {e}") from e
    config = model_config_from_llama(hf, seq_len)
    return config, from_llama_tensors(config, read_safetensors(directory))


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index lists."""
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFInteropError(
                f"{directory / INDEX} is not a safetensors index (a 'weight_map' of tensor "
                f"name -> file): {type(e).__name__}: {e}"
            ) from e
    else:
        found = sorted(p.name for p in directory.iterdir())
        raise HFInteropError(
            f"{directory} has neither {WEIGHTS} nor {INDEX} (found: {', '.join(found)}); "
            "pickled pytorch_model.bin files are not read (convert them to safetensors)"
        )
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        except Exception as e:  # safetensors raises its own error types for bad files
            raise HFInteropError(f"cannot read {path}: {e}") from e
    return tensors
