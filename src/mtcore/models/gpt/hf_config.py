"""config.json <-> GPTConfig for the HuggingFace decoders a llama-style GPT computes.

=============  ======================  =============================================
model_type     architecture            what it adds to Llama
=============  ======================  =============================================
``llama``      ``LlamaForCausalLM``    (Llama 1-3.x: ``llama3`` RoPE scaling, head_dim)
``mistral``    ``MistralForCausalLM``  ``sliding_window``
``qwen2``      ``Qwen2ForCausalLM``    biases on q, k and v (``qkv_bias``)
``mixtral``    ``MixtralForCausalLM``  routed experts in every layer (``model.moe``)
=============  ======================  =============================================

Export picks the architecture from the model (``default_architecture``) unless one is
asked for; whatever the chosen one cannot hold is refused, naming the part. Import
reads both RoPE forms: transformers 5's ``rope_parameters`` and the hub's older
``rope_scaling`` with a top-level ``rope_theta``. Export writes both.
"""

from __future__ import annotations

import torch
from pydantic import ValidationError

from mtcore.models.gpt.config import GPTConfig, RopeScaling
from mtcore.models.hf_files import DTYPE_NAMES, HFInteropError, check_model_type, need

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
_HF_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral"}
_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


# -- export ----------------------------------------------------------------------------
def default_architecture(config: GPTConfig) -> str:
    """The model_type that holds ``config``: mixtral (MoE), qwen2 (q/k/v biases),
    mistral (a sliding window), else llama."""
    if config.moe is not None:
        return "mixtral"
    if config.qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def check_exportable(config: GPTConfig, architecture: str) -> None:
    """Raise an HFInteropError naming what ``architecture`` cannot hold of ``config``."""
    if architecture not in ARCHITECTURES:
        raise HFInteropError(
            f"architecture {architecture!r} is not one of {', '.join(MODEL_TYPES)}"
        )
    if config.vocab_size is None:
        raise HFInteropError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    name = _HF_NAMES[architecture]
    wrong = {
        "norm": (config.norm, "rmsnorm"),
        "activation": (config.activation, "swiglu"),
        "position": (config.position, "rope"),
        "bias": (config.bias, False),
    }
    bad = [f"{k}={v!r} ({name} needs {want!r})" for k, (v, want) in wrong.items() if v != want]
    if bad:
        raise HFInteropError(
            f"a style={config.style!r} model cannot be exported as {name}: " + ", ".join(bad)
        )
    if architecture == "mixtral":
        _check_mixtral(config)
    elif config.moe is not None:
        raise HFInteropError(
            f"a mixture-of-experts model (model.moe) cannot be exported as {name}; "
            "export it as mixtral"
        )
    if config.qkv_bias and architecture != "qwen2":
        raise HFInteropError(f"qkv_bias=True: {name} has no q/k/v-only biases (export it as qwen2)")
    if config.sliding_window is not None and architecture == "llama":
        raise HFInteropError(
            f"sliding_window={config.sliding_window}: Llama has no sliding window "
            "(export it as mistral)"
        )


def _check_mixtral(config: GPTConfig) -> None:
    """Mixtral: softmax top-k routing renormalised over the k chosen, dropless, SwiGLU
    experts in every layer, no shared expert and no expert bias."""
    m = config.moe
    if m is None:
        raise HFInteropError("a dense model (model.moe unset) cannot be exported as Mixtral")
    problems = []
    if m.shared_ffn_size:
        problems.append(f"a shared expert (moe.shared_ffn_size={m.shared_ffn_size})")
    if m.bias_update_rate:
        problems.append(f"an expert bias (moe.bias_update_rate={m.bias_update_rate})")
    if config.moe_layer_freq != 1:
        problems.append(f"dense layers between MoE layers (moe_layer_freq={config.moe_layer_freq})")
    if m.score != "softmax":
        problems.append(f"moe.score={m.score!r} (Mixtral: softmax)")
    if not (m.topk_then_softmax or (m.norm_topk and m.top_k > 1)):
        problems.append("top-k weights that are not renormalised over the chosen experts")
    if m.capacity_factor is not None:
        problems.append(f"token dropping (moe.capacity_factor={m.capacity_factor})")
    if m.activation != "swiglu":
        problems.append(f"moe.activation={m.activation!r} (Mixtral: swiglu)")
    if problems:
        raise HFInteropError("Mixtral cannot hold " + "; ".join(problems))


def hf_config(
    config: GPTConfig, architecture: str | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    """The config.json of ``config`` as ``architecture`` (None: ``default_architecture``)."""
    architecture = architecture or default_architecture(config)
    check_exportable(config, architecture)
    rope = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rope = config.rope_scaling.model_dump()
    out = {
        "architectures": [ARCHITECTURES[architecture]],
        "model_type": architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size if config.moe is None else config.moe.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        # transformers < 5 reads rope_theta and rope_scaling; 5 reads rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        # Unknown without a tokenizer (the export fills them from one): transformers'
        # defaults (1, 2) would name arbitrary tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    out.update(_ARCHITECTURE_KEYS[architecture](config))
    return out


def _llama_keys(config: GPTConfig) -> dict:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def _mistral_keys(config: GPTConfig) -> dict:
    return {"sliding_window": config.sliding_window}


def _qwen2_keys(config: GPTConfig) -> dict:
    window = config.sliding_window
    kind = "full_attention" if window is None else "sliding_attention"
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": config.num_layers if window is None else 0,
        "layer_types": [kind] * config.num_layers,
    }


def _mixtral_keys(config: GPTConfig) -> dict:
    m = config.moe
    return {
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": config.sliding_window,
    }


_ARCHITECTURE_KEYS = {
    "llama": _llama_keys,
    "mistral": _mistral_keys,
    "qwen2": _qwen2_keys,
    "mixtral": _mixtral_keys,
}


# -- import ----------------------------------------------------------------------------
def model_config_from_hf(hf: dict, seq_len: int | None = None) -> GPTConfig:
    """The GPTConfig of a HuggingFace config.json (a dict) of a type in ``MODEL_TYPES``.

    ``seq_len``: mtcore's sequence length (the RoPE table and the training length);
    None takes ``max_position_embeddings``.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFInteropError(
            f"model_type={model_type!r}: only HuggingFace Llama, Mistral, Qwen2 and Mixtral "
            f"(model_type {', '.join(map(repr, MODEL_TYPES))}) map onto mtcore's GPT"
        )
    check_model_type(hf, model_type, _HF_NAMES[model_type], "GPT")
    _check_importable(hf, model_type)
    heads, hidden = need(hf, "num_attention_heads"), need(hf, "hidden_size")
    head_dim = hf.get("head_dim")
    seq_len = seq_len or need(hf, "max_position_embeddings")
    theta, scaling = _rope(hf)
    fields = dict(
        style="llama",
        vocab_size=need(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=need(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=need(hf, "intermediate_size"),
        seq_len=seq_len,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        # Only a head size that is not hidden / heads is stated (a round trip keeps
        # the config as it was).
        head_size=head_dim if head_dim is not None and head_dim * heads != hidden else None,
        qkv_bias=model_type == "qwen2",
        sliding_window=_sliding_window(hf, model_type, seq_len),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range") or 0.02,
    )
    if model_type == "mixtral":
        fields["moe"] = dict(
            num_experts=need(hf, "num_local_experts"),
            top_k=need(hf, "num_experts_per_tok"),
            ffn_size=need(hf, "intermediate_size"),
            # Softmax over the k chosen logits: Mixtral's softmax, top-k, renormalise.
            topk_then_softmax=True,
            aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001),
        )
    try:
        return GPTConfig(**fields)
    except ValidationError as e:
        raise HFInteropError(
            f"the {_HF_NAMES[model_type]} config does not make an mtcore model: {e}"
        ) from e


def _check_importable(hf: dict, model_type: str) -> None:
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFInteropError(
            f"hidden_act={hf['hidden_act']!r}: mtcore's SwiGLU gates with silu only"
        )
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise HFInteropError(f"{key}=true: mtcore's llama style has no biases")


def _sliding_window(hf: dict, model_type: str, seq_len: int) -> int | None:
    """The window of a Mistral (Mixtral) or of a Qwen2 with sliding layers; refused
    while shorter than ``seq_len`` (mtcore's attention has no window mask)."""
    window = hf.get("sliding_window")
    if model_type == "qwen2":
        sliding = "sliding_attention" in (hf.get("layer_types") or [])
        window = window if sliding or hf.get("use_sliding_window") else None
    elif model_type == "llama":
        window = None
    if window is not None and window < seq_len:
        raise HFInteropError(
            f"sliding_window={window} is shorter than seq_len={seq_len}: mtcore's attention "
            f"has no sliding-window mask yet; import with seq_len <= {window} (--seq-len "
            f"{window}), where the window hides nothing"
        )
    return window


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either config form; other scalings are refused."""
    theta, scaling = hf.get("rope_theta"), None
    params = hf.get("rope_parameters")
    for name, rope in (("rope_scaling", hf.get("rope_scaling")), ("rope_parameters", params)):
        if rope is None:
            continue
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise HFInteropError(f"{name}={rope!r}: only one RoPE for all layers maps")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            missing = [k for k in _SCALING_KEYS if rope.get(k) is None]
            if missing:
                raise HFInteropError(f"{name} of rope_type 'llama3' lacks {', '.join(missing)}")
            try:
                scaling = RopeScaling(**{k: rope[k] for k in _SCALING_KEYS})
            except ValidationError as e:
                raise HFInteropError(f"{name}: {e}") from e
        elif kind != "default":
            raise HFInteropError(
                f"{name} has rope_type={kind!r}: mtcore has plain RoPE and 'llama3' scaling "
                "(not linear, dynamic, yarn or longrope)"
            )
        theta = rope.get("rope_theta", theta)
    partial = hf.get("partial_rotary_factor", (params or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFInteropError(f"partial_rotary_factor={partial}: mtcore rotates whole heads")
    return float(theta if theta is not None else 10000.0), scaling
