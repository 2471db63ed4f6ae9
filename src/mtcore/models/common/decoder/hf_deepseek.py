"""HuggingFace DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> mtcore GPT with ``mla`` and ``moe``.

What DeepSeek-V3 adds to Llama, and where it lives in mtcore:

==========================================  ============================================
HuggingFace (layer i, ``model.layers.i.``)  mtcore (``layers.i.``)
==========================================  ============================================
``self_attn.q_a_proj`` / ``q_a_layernorm``   ``attn.q_down`` / ``attn.q_norm``
``self_attn.q_b_proj`` (or ``q_proj``)       ``attn.q_up`` (or ``attn.q``)
``self_attn.kv_a_proj_with_mqa``             ``attn.kv_down``
``self_attn.kv_a_layernorm``                 ``attn.kv_norm``
``self_attn.kv_b_proj``                      ``attn.kv_up``
``mlp.gate.weight``                          ``mlp.router.weight``
``mlp.gate.e_score_correction_bias``         ``mlp.router.expert_bias``
``mlp.experts.e.gate_proj | up_proj``        ``mlp.experts.fc1[e]`` (transposed)
``mlp.experts.e.down_proj``                  ``mlp.experts.fc2[e]`` (transposed)
``mlp.shared_experts.gate_proj | up_proj``   ``mlp.shared.fc1``
``mlp.shared_experts.down_proj``             ``mlp.shared.fc2``
==========================================  ============================================

Layers before ``first_k_dense_replace`` have Llama's dense MLP. DeepSeek's checkpoints
lay the rotary dims of q and k out in pairs (``rope_interleave: true``); mtcore rotates
halves, so the rope rows of ``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` are
permuted evens-then-odds on import and back on export. q and k get the same
permutation, so their dot product, and the logits, are unchanged.

The router maps to mtcore's sigmoid router with the aux-loss-free bias on
(``bias_update_rate`` 1e-3, DeepSeek-V3's), group-limited choice (``n_group``,
``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``; the balancing loss
is DeepSeek-V3's sequence-wise one at 1e-4. Multi-token-prediction layers
(``num_nextn_predict_layers``; transformers does not load them either) are skipped.

DeepSeek-V2 (``DeepseekV2ForCausalLM``) has the same tensors and rope layout (always
interleaved) but for the score bias, and routes by softmax over all experts: top-k of
those scores times ``routed_scaling_factor``, never renormalised (transformers ignores
``norm_topk_prob``, so ``true`` is refused), balanced by the sequence-wise loss at
``aux_loss_alpha`` (1e-3 when absent). ``topk_method: greedy`` maps; so does
``group_limited_greedy`` when ``topk_group`` keeps every group. A group limit that
drops groups is refused: V2 scores a group by its best expert, mtcore by its two best.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.models.common.hf_files import HFInteropError, TensorTaker, need

_ATTN = "self_attn."
_LATENT = {  # mtcore name -> HF name, one-to-one
    "attn.q_down.weight": "q_a_proj.weight",
    "attn.q_norm.weight": "q_a_layernorm.weight",
    "attn.kv_norm.weight": "kv_a_layernorm.weight",
    "attn.kv_up.weight": "kv_b_proj.weight",
}
_GATE_UP = ("gate_proj", "up_proj")
BIAS_UPDATE_RATE, SEQUENCE_AUX_LOSS = 1e-3, 1e-4


# -- config.json -----------------------------------------------------------------------
_NAMES = {"deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}
_SCORES = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
V2_AUX_LOSS = 1e-3


def deepseek_fields(hf: dict) -> dict:
    """The DecoderConfig fields a DeepSeek-V2 or -V3 config.json adds to Llama's."""
    if hf.get("attention_bias"):
        raise HFInteropError(
            "attention_bias=true: mtcore's multi-head latent attention has no biases"
        )
    heads = need(hf, "num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        raise HFInteropError(
            "num_key_value_heads differs from num_attention_heads: not DeepSeek's MLA"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise HFInteropError(
            f"moe_layer_freq={hf['moe_layer_freq']}: mtcore's DeepSeek layers are all MoE "
            "after the first_k_dense_replace dense ones"
        )
    routed, shared = need(hf, "n_routed_experts"), hf.get("n_shared_experts") or 0
    expert_ffn = need(hf, "moe_intermediate_size")
    return dict(
        mla=dict(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=need(hf, "kv_lora_rank"),
            qk_nope_head_dim=need(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=need(hf, "qk_rope_head_dim"),
            v_head_dim=need(hf, "v_head_dim"),
        ),
        first_dense_layers=hf.get("first_k_dense_replace") or 0,
        moe=dict(
            num_experts=routed,
            top_k=need(hf, "num_experts_per_tok"),
            ffn_size=expert_ffn,
            shared_ffn_size=shared * expert_ffn,
            routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
            aux_loss="seq",
            **(_v2_router(hf) if hf["model_type"] == "deepseek_v2" else _v3_router(hf)),
        ),
    )


def _v3_router(hf: dict) -> dict:
    groups = hf.get("n_group") or 1
    return dict(
        score="sigmoid",
        norm_topk=bool(hf.get("norm_topk_prob", True)),
        expert_groups=groups,
        top_groups=hf.get("topk_group") or groups,
        bias_update_rate=BIAS_UPDATE_RATE,
        aux_loss_coeff=SEQUENCE_AUX_LOSS,
    )


def _v2_router(hf: dict) -> dict:
    method, groups = hf.get("topk_method", "greedy"), hf.get("n_group") or 1
    if method not in ("greedy", "group_limited_greedy"):
        raise HFInteropError(f"topk_method={method!r}: DeepSeek-V2 routes greedily")
    if method == "group_limited_greedy" and (hf.get("topk_group") or groups) < groups:
        raise HFInteropError(
            f"topk_method='group_limited_greedy' with topk_group={hf['topk_group']} < "
            f"n_group={groups}: mtcore scores a group by its two best experts, DeepSeek-V2 "
            "by its best"
        )
    if hf.get("norm_topk_prob"):
        raise HFInteropError(
            "norm_topk_prob=true: transformers' DeepSeek-V2 does not renormalise the weights"
        )
    coeff = hf.get("aux_loss_alpha")
    return dict(
        score="softmax",
        norm_topk=False,
        expert_groups=1,
        top_groups=1,
        aux_loss_coeff=V2_AUX_LOSS if coeff is None else coeff,
    )


def check_deepseek(config, architecture: str) -> None:
    """Raise an HFInteropError naming what DeepSeek-V2 or -V3 (``architecture``)
    cannot hold of ``config``."""
    m, mla, problems = config.moe, config.mla, []
    name, score = _NAMES[architecture], _SCORES[architecture]
    if mla is None:
        problems.append(
            f"grouped-query attention ({name} has multi-head latent attention: set mla)"
        )
    elif mla.latent_norm_eps != 1e-6:
        problems.append(f"mla.latent_norm_eps={mla.latent_norm_eps} ({name}: 1e-6)")
    if m is None:
        problems.append(f"a dense model ({name} has routed experts: set moe)")
    else:
        if m.score != score:
            problems.append(f"moe.score={m.score!r} ({name}: {score})")
        if m.topk_then_softmax:
            problems.append(f"moe.topk_then_softmax ({name} weighs by scores over all experts)")
        if m.shared_ffn_size % m.ffn_size:
            problems.append(
                f"moe.shared_ffn_size={m.shared_ffn_size}, not a multiple of moe.ffn_size={m.ffn_size}"
            )
        if m.capacity_factor is not None:
            problems.append(f"token dropping (moe.capacity_factor={m.capacity_factor})")
        if m.activation != "swiglu":
            problems.append(f"moe.activation={m.activation!r} ({name}: swiglu)")
        if architecture == "deepseek_v2":
            if m.norm_topk:
                problems.append("moe.norm_topk (transformers' DeepSeek-V2 never renormalises)")
            if (m.top_groups or m.expert_groups) < m.expert_groups:
                problems.append(
                    f"moe.top_groups={m.top_groups} < moe.expert_groups={m.expert_groups} "
                    "(DeepSeek-V2 scores a group by its best expert, mtcore by its two best)"
                )
        elif m.norm_topk and m.top_k == 1:
            problems.append("norm_topk with top_k=1 (mtcore keeps the single weight as it is)")
    if config.moe_layer_freq != 1:
        problems.append(f"dense layers between MoE layers (moe_layer_freq={config.moe_layer_freq})")
    if problems:
        raise HFInteropError(f"{name} cannot hold " + "; ".join(problems))


def deepseek_keys(config, architecture: str) -> dict:
    """The config.json keys of DeepSeek-V2 or -V3 (``architecture``) beyond Llama's."""
    m, mla = config.moe, config.mla
    keys = {
        "intermediate_size": config.ffn_size,
        "moe_intermediate_size": m.ffn_size,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.shared_ffn_size // m.ffn_size,
        "num_experts_per_tok": m.top_k,
        "routed_scaling_factor": m.routed_scale,
        "n_group": m.expert_groups,
        "topk_group": m.top_groups or m.expert_groups,
        "norm_topk_prob": m.norm_topk,
        "first_k_dense_replace": config.first_dense_layers,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "attention_bias": False,
    }
    if architecture == "deepseek_v2":
        return {**keys, "topk_method": "greedy", "aux_loss_alpha": m.aux_loss_coeff}
    return {**keys, "rope_interleave": True, "num_nextn_predict_layers": 0}


# -- tensors ---------------------------------------------------------------------------
def _halves_order(rope_dim: int) -> Tensor:
    """Rows of an interleaved rope part in rotate-half order: evens, then odds."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _permute_rope_rows(weight: Tensor, head_rows: int, rope_dim: int, inverse: bool) -> Tensor:
    """``weight`` whose rows are heads of ``head_rows`` each ending in ``rope_dim`` rope
    rows, with the rope rows of every head reordered (interleaved <-> halves)."""
    order = _halves_order(rope_dim)
    if inverse:
        order = torch.argsort(order)
    heads = weight.view(-1, head_rows, weight.shape[-1])
    nope, rope = heads.split([head_rows - rope_dim, rope_dim], 1)
    return torch.cat([nope, rope[:, order]], 1).reshape_as(weight)


def latent_attention_from_hf(config, source: TensorTaker, mine: str, theirs: str) -> dict:
    """``layers.i.attn.*`` (but ``proj``) from ``model.layers.i.self_attn.*``."""
    mla, out = config.mla, {}
    qk, rope, theirs = mla.qk_head_dim, mla.qk_rope_head_dim, theirs + _ATTN
    for m, h in _LATENT.items():
        if mla.q_lora_rank is not None or not m.startswith("attn.q_"):
            out[mine + m] = source.take(theirs + h)
    q_name, q_hf = ("attn.q.weight", "q_proj.weight")
    if mla.q_lora_rank is not None:
        q_name, q_hf = ("attn.q_up.weight", "q_b_proj.weight")
    out[mine + q_name] = _permute_rope_rows(source.take(theirs + q_hf), qk, rope, inverse=False)
    kv_down = source.take(theirs + "kv_a_proj_with_mqa.weight")
    out[mine + "attn.kv_down.weight"] = _permute_rope_rows(kv_down, kv_down.shape[0], rope, False)
    return out


def latent_attention_to_hf(config, weights: dict, mine: str, theirs: str) -> dict:
    """The inverse of ``latent_attention_from_hf``."""
    mla, out = config.mla, {}
    qk, rope, theirs = mla.qk_head_dim, mla.qk_rope_head_dim, theirs + _ATTN
    for m, h in _LATENT.items():
        if mine + m in weights:
            out[theirs + h] = weights[mine + m]
    q_name, q_hf = ("attn.q.weight", "q_proj.weight")
    if mla.q_lora_rank is not None:
        q_name, q_hf = ("attn.q_up.weight", "q_b_proj.weight")
    out[theirs + q_hf] = _permute_rope_rows(weights[mine + q_name], qk, rope, inverse=True)
    kv_down = weights[mine + "attn.kv_down.weight"]
    out[theirs + "kv_a_proj_with_mqa.weight"] = _permute_rope_rows(
        kv_down, kv_down.shape[0], rope, True
    )
    return out


def gated_experts_from_hf(
    config, source: TensorTaker, mine: str, theirs: str, expert_bias: bool
) -> dict:
    """``layers.i.mlp.*`` of a MoE layer from ``model.layers.i.mlp.*`` (DeepSeek's and
    Qwen3-MoE's names; ``expert_bias``: the checkpoint has DeepSeek-V3's score bias)."""
    m, theirs = config.moe, theirs + "mlp."

    def stack(name: str) -> Tensor:
        return torch.stack(
            [source.take(f"{theirs}experts.{e}.{name}.weight").t() for e in range(m.num_experts)]
        )

    out = {
        mine + "router.weight": source.take(theirs + "gate.weight"),
        mine + "router.expert_bias": source.take(theirs + "gate.e_score_correction_bias")
        if expert_bias
        else torch.zeros(m.num_experts),
        mine + "experts.fc1": torch.cat([stack(name) for name in _GATE_UP], dim=2),
        mine + "experts.fc2": stack("down_proj"),
    }
    if m.shared_ffn_size:
        shared = theirs + "shared_experts."
        out[mine + "shared.fc1.weight"] = torch.cat(
            [source.take(f"{shared}{name}.weight") for name in _GATE_UP]
        )
        out[mine + "shared.fc2.weight"] = source.take(shared + "down_proj.weight")
    return out


def gated_experts_to_hf(config, weights: dict, mine: str, theirs: str, expert_bias: bool) -> dict:
    """The inverse of ``gated_experts_from_hf``."""
    m, theirs = config.moe, theirs + "mlp."
    f, bias = m.ffn_size, weights[mine + "router.expert_bias"]
    out = {theirs + "gate.weight": weights[mine + "router.weight"]}
    if expert_bias:
        out[theirs + "gate.e_score_correction_bias"] = bias
    elif bias.abs().max() > 0:
        raise HFInteropError(f"{mine}router.expert_bias is nonzero: the router has no expert bias")
    fc1, fc2 = weights[mine + "experts.fc1"], weights[mine + "experts.fc2"]
    for e in range(m.num_experts):
        out[f"{theirs}experts.{e}.gate_proj.weight"] = fc1[e, :, :f].t()
        out[f"{theirs}experts.{e}.up_proj.weight"] = fc1[e, :, f:].t()
        out[f"{theirs}experts.{e}.down_proj.weight"] = fc2[e].t()
    if m.shared_ffn_size:
        gate, up = weights[mine + "shared.fc1.weight"].split(m.shared_ffn_size)
        shared = theirs + "shared_experts."
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = gate, up
        out[shared + "down_proj.weight"] = weights[mine + "shared.fc2.weight"]
    return out
