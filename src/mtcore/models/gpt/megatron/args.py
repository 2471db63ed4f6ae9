"""Megatron-LM's model arguments <-> ``GPTConfig``.

Megatron-LM saves its parsed arguments (an ``argparse.Namespace``) in every
checkpoint; a launch script passes the same ones as ``--num-layers 32 --swiglu ...``.
Both reach this module as a mapping of Megatron's attribute names (``num_layers``,
``swiglu``), over ``MEGATRON_DEFAULTS`` (Megatron-LM's own defaults, for what a
script leaves out). What mtcore's GPT cannot express is refused with a
``MegatronError`` naming the argument: a silent difference would give other logits.

==================================================  ==================================
Megatron-LM                                         mtcore ``GPTConfig``
==================================================  ==================================
``--normalization LayerNorm | RMSNorm``              ``norm``
``--swiglu`` (else GeLU: erf, or tanh with           ``activation``, ``gelu_approximate``
``--openai-gelu``)
``--position-embedding-type learned_absolute|rope``  ``position`` (learned: ``seq_len`` =
                                                     ``--max-position-embeddings``)
``--disable-bias-linear``, ``--add-qkv-bias``        ``bias``, ``qkv_bias``
``--untie-embeddings-and-output-weights``            ``tie_embeddings`` False
``--group-query-attention --num-query-groups G``     ``num_kv_heads`` G
``--kv-channels``                                    ``head_size``
``--num-experts``, ``--moe-router-topk``,            ``moe`` (Mixtral order: softmax over
``--moe-ffn-hidden-size``, ``--moe-layer-freq``      the k chosen logits)
==================================================  ==================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtcore.models.gpt.config import GPTConfig


class MegatronError(ValueError):
    """A Megatron checkpoint or argument that mtcore cannot map; the message names it."""


def _default_ffn(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's --ffn-hidden-size when none is given (validate_args): 4h, or with
    SwiGLU two thirds of it rounded down to a multiple of 64."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


# Megatron-LM's defaults (megatron/training/arguments.py) of the arguments read here.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "num_query_groups": 1,
    "group_query_attention": False,
    "kv_channels": None,
    "ffn_hidden_size": None,
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "openai_gelu": False,
    "squared_relu": False,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "use_rope_scaling": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False,
    "qk_layernorm": False,
    "apply_residual_connection_post_layernorm": False,
    "multi_latent_attention": False,
    "init_method_std": 0.02,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "make_vocab_size_divisible_by": 128,
    "num_experts": None,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
}

# Megatron-LM 0.16 saves some arguments under the name of the TransformerConfig field its
# flag sets (``--norm-epsilon`` -> ``layernorm_epsilon``); older ones under the flag's.
_SAVED_AS = {
    "norm_epsilon": "layernorm_epsilon",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
}

# Every argument model_config_from_megatron reads.
MODEL_ARGUMENTS = (
    *MEGATRON_DEFAULTS,
    *_SAVED_AS.values(),
    "num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length",
    "padded_vocab_size",
)  # fmt: skip

# Arguments whose non-default value changes the model in a way mtcore has no switch for
# (each checked against Megatron-LM core_v0.16.1's parser: docs/migrating-from-megatron.md).
_UNSUPPORTED = {
    "apply_layernorm_1p": "--apply-layernorm-1p (zero-centred norm weights: 1 + gamma)",
    "attention_output_gate": "--attention-output-gate",
    "experimental_attention_variant": "--experimental-attention-variant",
    "glu_linear_offset": "--glu-linear-offset",
    "activation_func_clamp_value": "--activation-func-clamp-value",
    "quick_geglu": "--quick-geglu",
    "use_fused_weighted_squared_relu": "--use-fused-weighted-squared-relu",
    "qk_l2_norm": "--qk-l2-norm",
    "no_rope_freq": "--no-rope-freq (layers without RoPE)",
    "rotary_seq_len_interpolation_factor": "--rotary-seq-len-interpolation-factor",
    "window_size": "--window-size (sliding-window attention)",
    "window_attn_skip_freq": "--window-attn-skip-freq",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
    "heterogeneous_layers_config_encoded_json": "--heterogeneous-layers-config-encoded-json",
    "linear_attention_freq": "--linear-attention-freq",
    "hybrid_attention_ratio": "--hybrid-attention-ratio",
    "moe_apply_probs_on_input": "--moe-apply-probs-on-input",
    "moe_latent_size": "--moe-latent-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate",
    "moe_router_group_topk": "--moe-router-group-topk (group-limited routing)",
    "qk_layernorm": "--qk-layernorm (norms on queries and keys)",
    "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
    "multi_latent_attention": "--multi-latent-attention (MLA)",
    "rotary_interleaved": "--rotary-interleaved (interleaved RoPE pairs)",
    "use_rope_scaling": "--use-rope-scaling",
    "squared_relu": "--squared-relu",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_router_num_groups": "--moe-router-num-groups (group-limited routing)",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "mtp_num_layers": "--mtp-num-layers (multi-token prediction)",
}


# Arguments refused unless they hold Megatron-LM's default: name -> (default, flag).
_ONLY_DEFAULT = {
    "softmax_type": ("vanilla", "--softmax-type"),
}


def _value(args: Mapping[str, Any], name: str) -> Any:
    for saved in (name, _SAVED_AS.get(name)):
        if saved in args and args[saved] is not None:
            return args[saved]
    return MEGATRON_DEFAULTS.get(name)


def model_config_from_megatron(args: Mapping[str, Any], vocab_size: int | None = None) -> GPTConfig:
    """The ``GPTConfig`` of Megatron-LM arguments (attribute names: ``vars(args)``).

    vocab_size: the embedding's rows (Megatron's ``padded_vocab_size``); None takes it
    from ``padded_vocab_size`` in ``args``, else leaves it for the tokenizer.
    """
    get = lambda name: _value(args, name)  # noqa: E731
    for name, what in _UNSUPPORTED.items():
        if get(name):
            raise MegatronError(f"{what} is not supported by mtcore's GPT")
    for name, (default, flag) in _ONLY_DEFAULT.items():
        if args.get(name, default) not in (default, None):
            raise MegatronError(f"{flag} {args[name]} is not supported by mtcore's GPT")
    if get("rope_type") not in (None, "rope"):
        raise MegatronError(f"--rope-type {get('rope_type')} is not supported (rope)")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if get(name) is None:
            raise MegatronError(
                f"the Megatron arguments have no {name} (--{name.replace('_', '-')})"
            )
    position = get("position_embedding_type")
    if position not in ("learned_absolute", "rope"):
        raise MegatronError(
            f"--position-embedding-type {position} is not supported (learned_absolute, rope)"
        )
    # Megatron-LM 0.16 builds position embeddings from --position-embedding-type alone;
    # --no-position-embedding is a no-op beside rope and an error (deprecated) otherwise.
    if args.get("add_position_embedding") is False and position != "rope":
        raise MegatronError(
            "--no-position-embedding is not supported without --position-embedding-type "
            "rope (Megatron-LM refuses it too)"
        )
    if position == "rope" and float(get("rotary_percent")) != 1.0:
        raise MegatronError(f"--rotary-percent {get('rotary_percent')} is not supported (only 1.0)")
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(get("normalization"))
    if norm is None:
        raise MegatronError(f"--normalization {get('normalization')} is not supported")
    # Megatron-LM requires --max-position-embeddings (validate_args' required_args); a
    # rope model's context is its --seq-length when given.
    seq_len = (
        get("max_position_embeddings")
        if position == "learned_absolute"
        else get("seq_length") or get("max_position_embeddings")
    )
    if seq_len is None:
        raise MegatronError(
            "the Megatron arguments have neither --seq-length nor --max-position-embeddings"
            if position == "rope"
            else "the Megatron arguments have no --max-position-embeddings (the size of the "
            "learned position table)"
        )
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    fields: dict[str, Any] = dict(
        style="llama" if get("swiglu") else "gpt2",
        num_layers=int(get("num_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(get("num_query_groups")) if get("group_query_attention") else None,
        ffn_hidden_size=int(get("ffn_hidden_size") or _default_ffn(hidden, get("swiglu"))),
        norm=norm,
        norm_eps=float(get("norm_epsilon")),
        activation="swiglu" if get("swiglu") else "gelu",
        gelu_approximate="tanh" if get("swiglu") or get("openai_gelu") else "none",
        position="rope" if position == "rope" else "learned",
        rope_theta=float(get("rotary_base")),
        bias=bool(get("add_bias_linear")),
        qkv_bias=bool(get("add_qkv_bias")) and not get("add_bias_linear"),
        tie_embeddings=not get("untie_embeddings_and_output_weights"),
        init_std=float(get("init_method_std")),
        dropout=0.0,  # Megatron's dropout is a training setting; the trainer's config sets it
        seq_len=int(seq_len),
    )
    kv_channels = get("kv_channels")
    if kv_channels is not None and int(kv_channels) != hidden // heads:
        fields["head_size"] = int(kv_channels)
    if get("num_experts"):
        fields.update(_moe_fields(get, fields))
    vocab = vocab_size if vocab_size is not None else get("padded_vocab_size")
    if vocab is not None:
        fields["vocab_size"] = int(vocab)
    try:
        return GPTConfig(**fields)
    except ValueError as e:
        first = str(e).strip().splitlines()
        raise MegatronError(
            f"the Megatron model does not validate as mtcore's GPT: {' '.join(first[:3])}"
        ) from None


def _moe_fields(get, fields: dict) -> dict:
    experts = int(get("num_experts"))
    if get("add_bias_linear"):
        raise MegatronError(
            "--num-experts with biased linears (no --disable-bias-linear): mtcore's experts have no biases"
        )
    if get("moe_shared_expert_intermediate_size"):
        raise MegatronError(
            "--moe-shared-expert-intermediate-size (shared experts) is not supported yet"
        )
    if get("moe_router_score_function") != "softmax":
        raise MegatronError(
            f"--moe-router-score-function {get('moe_router_score_function')} is not supported"
        )
    if not get("swiglu") and not get("openai_gelu"):
        raise MegatronError(
            "MoE experts with erf GeLU: mtcore's experts use swiglu or tanh GeLU (--openai-gelu)"
        )
    freq = get("moe_layer_freq")
    if not isinstance(freq, int):
        raise MegatronError(f"--moe-layer-freq {freq!r}: only an integer (every k-th layer) maps")
    balancing = get("moe_router_load_balancing_type")
    capacity = get("moe_expert_capacity_factor")
    moe = dict(
        num_experts=experts,
        top_k=int(get("moe_router_topk")),
        ffn_size=int(get("moe_ffn_hidden_size") or fields["ffn_hidden_size"]),
        activation=fields["activation"],
        topk_then_softmax=not get("moe_router_pre_softmax"),
        norm_topk=False,
        aux_loss="seq"
        if balancing == "seq_aux_loss"
        else "none"
        if balancing == "none"
        else "batch",
        aux_loss_coeff=float(get("moe_aux_loss_coeff")),
        z_loss_coeff=float(get("moe_z_loss_coeff") or 0.0),
        capacity_factor=None if capacity is None else float(capacity),
    )
    return {"moe": moe, "moe_layer_freq": int(freq)}


def _rotary_base(theta: float) -> int:
    """Megatron-LM parses ``--rotary-base`` as an int: a fractional base has no flag."""
    if theta != int(theta):
        raise MegatronError(f"rope_theta={theta}: Megatron-LM's --rotary-base is an integer")
    return int(theta)


def megatron_args(config: GPTConfig, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Megatron-LM's model arguments (attribute names) for ``config`` at ``tp`` x ``pp``:
    what a checkpoint written by ``to-megatron`` records, and what Megatron-LM needs to
    build the model that loads it. ``make_vocab_size_divisible_by`` is
    ``vocab_size / tp``, so Megatron pads any tokenizer of at most ``vocab_size``
    tokens to exactly mtcore's vocabulary."""
    if config.vocab_size is None or config.vocab_size % tp:
        raise MegatronError(f"vocab_size={config.vocab_size} is not divisible by tp={tp}")
    if getattr(config, "rope_scaling", None) is not None or config.sliding_window is not None:
        raise MegatronError("rope_scaling and sliding_window have no Megatron argument here")
    deepseek = dict(
        mla=config.mla is not None,
        qk_norm=config.qk_norm,
        mtp=config.mtp is not None,
        first_dense_layers=config.first_dense_layers > 0,
    )
    if any(deepseek.values()):
        named = ", ".join(name for name, used in deepseek.items() if used)
        raise MegatronError(f"{named}: not exported to Megatron (DeepSeek/Qwen3 options)")
    args: dict[str, Any] = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_size,
        num_attention_heads=config.num_heads,
        group_query_attention=config.kv_heads != config.num_heads,
        num_query_groups=config.kv_heads,
        kv_channels=config.head_dim,
        max_position_embeddings=config.seq_len,
        seq_length=config.seq_len,
        position_embedding_type="rope" if config.position == "rope" else "learned_absolute",
        rotary_base=_rotary_base(config.rope_theta) if config.position == "rope" else 10000,
        rotary_percent=1.0,
        normalization="RMSNorm" if config.norm == "rmsnorm" else "LayerNorm",
        norm_epsilon=config.norm_eps,
        layernorm_epsilon=config.norm_eps,  # where Megatron-LM 0.16 saves --norm-epsilon
        swiglu=config.activation == "swiglu",
        openai_gelu=config.activation == "gelu" and config.gelu_approximate == "tanh",
        add_bias_linear=config.bias,
        add_qkv_bias=config.bias or config.qkv_bias,
        untie_embeddings_and_output_weights=not config.tie_embeddings,
        init_method_std=config.init_std,
        padded_vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=config.vocab_size // tp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    if config.moe is not None:
        m = config.moe
        if m.shared_ffn_size or m.score != "softmax" or m.bias_update_rate:
            raise MegatronError("shared experts, sigmoid scores and expert biases are not exported")
        if m.expert_groups > 1 or m.routed_scale != 1.0:
            raise MegatronError("group-limited routing and routed_scale are not exported")
        if not m.topk_then_softmax and (m.norm_topk and m.top_k > 1):
            raise MegatronError(
                "moe: softmax over all experts with norm_topk has no Megatron router"
            )
        args.update(
            num_experts=m.num_experts,
            moe_router_topk=m.top_k,
            moe_ffn_hidden_size=m.ffn_size,
            moe_layer_freq=config.moe_layer_freq,
            moe_router_pre_softmax=not m.topk_then_softmax,
            moe_aux_loss_coeff=m.aux_loss_coeff,
            moe_expert_capacity_factor=m.capacity_factor,
        )
    return args
