"""config.json <-> DecoderConfig for the HuggingFace decoders a llama-style GPT computes.

=============  ======================  =============================================
model_type     architecture            what it adds to Llama
=============  ======================  =============================================
``llama``      ``LlamaForCausalLM``    (Llama 1-3.x: ``llama3`` RoPE scaling, head_dim)
``mistral``    ``MistralForCausalLM``  ``sliding_window``
``qwen2``      ``Qwen2ForCausalLM``    biases on q, k and v (``qkv_bias``)
``mixtral``    ``MixtralForCausalLM``  routed experts in every layer (``model.moe``)
``deepseek_v2``  ``DeepseekV2ForCausalLM``  latent attention (``mla``), shared and
               softmax-routed experts, YaRN (``hf_deepseek``)
``deepseek_v3``  ``DeepseekV3ForCausalLM``  as V2, with grouped sigmoid-routed experts
``qwen3``      ``Qwen3ForCausalLM``    an RMSNorm on each q and k head (``qk_norm``)
``qwen3_moe``  ``Qwen3MoeForCausalLM`` ``qk_norm``, softmax-routed experts (no shared one)
=============  ======================  =============================================

Export picks the architecture from the model (``default_architecture``) unless one is
asked for; whatever the chosen one cannot hold is refused, naming the part. Import
reads both RoPE forms: transformers 5's ``rope_parameters`` and the hub's older
``rope_scaling`` with a top-level ``rope_theta``. Export writes both.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from pydantic import ValidationError

from mtcore.models.common.decoder.config import DecoderConfig, RopeScaling
from mtcore.models.common.decoder.hf_architectures import ARCHITECTURES, MODEL_TYPES
from mtcore.models.common.decoder.hf_deepseek import check_deepseek, deepseek_fields, deepseek_keys
from mtcore.models.common.decoder.hf_experts import check_mixtral, check_qwen3_moe
from mtcore.models.common.hf_files import DTYPE_NAMES, HFInteropError, check_model_type, need

_HF_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "mixtral": "Mixtral",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
}
_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


# -- export ----------------------------------------------------------------------------
def default_architecture(config: DecoderConfig) -> str:
    """The model_type that holds ``config``: deepseek_v2 / deepseek_v3 (latent attention,
    softmax / sigmoid router), mixtral (MoE), qwen2 (q/k/v biases), mistral (a sliding
    window), else llama."""
    if config.mla is not None:
        softmax = config.moe is not None and config.moe.score == "softmax"
        return "deepseek_v2" if softmax else "deepseek_v3"
    if config.qk_norm:
        return "qwen3_moe" if config.moe is not None else "qwen3"
    if config.moe is not None:
        return "mixtral"
    if config.qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def check_exportable(config: DecoderConfig, architecture: str) -> None:
    """Raise an HFInteropError naming what ``architecture`` cannot hold of ``config``."""
    if architecture not in ARCHITECTURES:
        raise HFInteropError(
            f"architecture {architecture!r} is not one of {', '.join(MODEL_TYPES)}"
        )
    if config.vocab_size is None:
        raise HFInteropError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    if config.mtp is not None:
        raise HFInteropError(
            "model.mtp: multi-token prediction modules are not exported (transformers does "
            "not load them); export the model without them"
        )
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
    if architecture.startswith("deepseek"):
        check_deepseek(config, architecture)
    elif config.mla is not None:
        raise HFInteropError(f"multi-head latent attention (mla) cannot be exported as {name}")
    elif architecture == "mixtral":
        check_mixtral(config)
    elif architecture == "qwen3_moe":
        check_qwen3_moe(config)
    elif config.moe is not None:
        raise HFInteropError(
            f"a mixture-of-experts model (model.moe) cannot be exported as {name}; "
            "export it as mixtral"
        )
    if config.qk_norm and not architecture.startswith("qwen3"):
        raise HFInteropError(
            f"qk_norm=True: {name} has no norm on q and k heads (export it as qwen3)"
        )
    if architecture.startswith("qwen3") and not config.qk_norm:
        raise HFInteropError(f"qk_norm=False: {name} normalises each q and k head")
    if config.qkv_bias and architecture != "qwen2":
        raise HFInteropError(f"qkv_bias=True: {name} has no q/k/v-only biases (export it as qwen2)")
    if config.sliding_window is not None and architecture == "llama":
        raise HFInteropError(
            f"sliding_window={config.sliding_window}: Llama has no sliding window "
            "(export it as mistral)"
        )


def hf_config(
    config: DecoderConfig, architecture: str | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    """The config.json of ``config`` as ``architecture`` (None: ``default_architecture``)."""
    architecture = architecture or default_architecture(config)
    check_exportable(config, architecture)
    rope = {"rope_type": "default"}
    if config.rope_scaling is not None:
        keys = _SCALING_KEYS if config.rope_scaling.rope_type == "llama3" else _YARN_KEYS
        rope = config.rope_scaling.model_dump(include={"rope_type", *keys})
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
        "attention_dropout": config.attention_dropout,
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


def _llama_keys(config: DecoderConfig) -> dict:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def _mistral_keys(config: DecoderConfig) -> dict:
    return {"sliding_window": config.sliding_window}


def _qwen2_keys(config: DecoderConfig) -> dict:
    window = config.sliding_window
    kind = "full_attention" if window is None else "sliding_attention"
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": config.num_layers if window is None else 0,
        "layer_types": [kind] * config.num_layers,
    }


def _mixtral_keys(config: DecoderConfig) -> dict:
    m = config.moe
    return {
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": config.sliding_window,
    }


def _qwen3_keys(config: DecoderConfig) -> dict:
    return {**_qwen2_keys(config), "attention_bias": False}


def _qwen3_moe_keys(config: DecoderConfig) -> dict:
    m = config.moe
    return {
        **_qwen3_keys(config),
        "intermediate_size": config.ffn_size,
        "moe_intermediate_size": m.ffn_size,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.first_dense_layers)),
        "router_aux_loss_coef": m.aux_loss_coeff,
        "output_router_logits": False,
    }


_ARCHITECTURE_KEYS = {
    "llama": _llama_keys,
    "mistral": _mistral_keys,
    "qwen2": _qwen2_keys,
    "mixtral": _mixtral_keys,
    "deepseek_v2": partial(deepseek_keys, architecture="deepseek_v2"),
    "deepseek_v3": partial(deepseek_keys, architecture="deepseek_v3"),
    "qwen3": _qwen3_keys,
    "qwen3_moe": _qwen3_moe_keys,
}


# -- import ----------------------------------------------------------------------------
def model_config_from_hf(
    hf: dict, seq_len: int | None, config_class: Callable[..., DecoderConfig]
) -> DecoderConfig:
    """The config (a ``config_class``: the family's) of a HuggingFace config.json (a dict)
    of a type in ``MODEL_TYPES``.

    ``seq_len``: mtcore's sequence length (the RoPE table and the training length);
    None takes ``max_position_embeddings``.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFInteropError(
            f"model_type={model_type!r}: only HuggingFace Llama, Mistral, Qwen2, Mixtral, DeepSeek and Qwen3 "
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
        attention_dropout=hf.get("attention_dropout") or 0.0,
    )
    if model_type.startswith("qwen3"):
        fields["qk_norm"] = True
    if model_type == "qwen3_moe":
        fields.update(_qwen3_moe_fields(hf))
    if model_type.startswith("deepseek"):  # head_dim is the rope part's
        fields.update(deepseek_fields(hf), head_size=None)
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
        return config_class(**fields)
    except ValidationError as e:
        raise HFInteropError(
            f"the {_HF_NAMES[model_type]} config does not make an mtcore model: {e}"
        ) from e


def _qwen3_moe_fields(hf: dict) -> dict:
    """Qwen3-MoE's experts: MoE in every layer but the first ``mlp_only_layers``."""
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or hf.get("decoder_sparse_step", 1) != 1:
        raise HFInteropError(
            f"mlp_only_layers={dense}, decoder_sparse_step={hf.get('decoder_sparse_step')}: "
            "mtcore's dense layers are the first k (first_dense_layers) with MoE in all the rest"
        )
    return dict(
        first_dense_layers=len(dense),
        moe=dict(
            # The hub's configs say num_experts; transformers 5 writes num_local_experts.
            num_experts=hf.get("num_experts") or need(hf, "num_local_experts"),
            top_k=need(hf, "num_experts_per_tok"),
            ffn_size=need(hf, "moe_intermediate_size"),
            norm_topk=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001),
        ),
    )


def _check_importable(hf: dict, model_type: str) -> None:
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFInteropError(
            f"hidden_act={hf['hidden_act']!r}: mtcore's SwiGLU gates with silu only"
        )
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise HFInteropError(f"{key}=true: mtcore's llama style has no biases")


def _sliding_window(hf: dict, model_type: str, seq_len: int) -> int | None:
    """The window of a Mistral (Mixtral) or of a Qwen2 (Qwen3) whose layers all slide.

    A Qwen2 slides in the layers ``layer_types`` names ``sliding_attention`` (older
    configs: ``use_sliding_window`` and the layers from ``max_window_layers`` on). mtcore
    has one window for every layer, so a mix is refused while the window hides keys.
    """
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        kinds = hf.get("layer_types") or _qwen2_layer_kinds(hf)
        sliding = [kind == "sliding_attention" for kind in kinds]
        if not any(sliding):
            return None
        if not all(sliding) and window is not None and window < seq_len:
            raise HFInteropError(
                f"sliding_window={window} in layers {[i for i, s in enumerate(sliding) if s]} "
                f"only: mtcore's GPT has one window for every layer; import with seq_len <= "
                f"{window} (--seq-len {window}), where the window hides nothing"
            )
    elif model_type in ("llama", "deepseek_v2", "deepseek_v3"):
        window = None
    return window


def _yarn(name: str, rope: dict) -> RopeScaling:
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise HFInteropError(f"{name}: yarn with attention_factor or truncate=false does not map")
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        raise HFInteropError(f"{name} of rope_type 'yarn' lacks {', '.join(missing)}")
    try:
        present = {k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}
        return RopeScaling(rope_type="yarn", **present)
    except ValidationError as e:
        raise HFInteropError(f"{name}: {e}") from e


def _qwen2_layer_kinds(hf: dict) -> list[str]:
    layers = need(hf, "num_hidden_layers")
    if not hf.get("use_sliding_window"):
        return ["full_attention"] * layers
    first = hf.get("max_window_layers", layers)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


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
        elif kind == "yarn":
            scaling = _yarn(name, rope)
        elif kind != "default":
            raise HFInteropError(
                f"{name} has rope_type={kind!r}: mtcore has plain RoPE, 'llama3' and 'yarn' "
                "scaling (not linear, dynamic or longrope)"
            )
        theta = rope.get("rope_theta", theta)
    partial = hf.get("partial_rotary_factor", (params or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFInteropError(f"partial_rotary_factor={partial}: mtcore rotates whole heads")
    return float(theta if theta is not None else 10000.0), scaling
