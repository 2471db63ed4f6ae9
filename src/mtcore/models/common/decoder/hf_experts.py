"""What the HuggingFace MoE architectures with softmax-routed experts (Mixtral, Qwen3-MoE)
cannot hold of a GPT's ``moe``: each check names every part it refuses."""

from __future__ import annotations

from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.hf_files import HFInteropError


def softmax_expert_problems(config: DecoderConfig, name: str) -> list[str]:
    """What a Mixtral or a Qwen3-MoE (softmax-routed, dropless SwiGLU experts in every
    layer, no shared expert, expert bias, groups or routed scale) cannot hold."""
    m = config.moe
    if m is None:
        raise HFInteropError(f"a dense model (model.moe unset) cannot be exported as {name}")
    problems = []
    if m.shared_ffn_size:
        problems.append(f"a shared expert (moe.shared_ffn_size={m.shared_ffn_size})")
    if m.bias_update_rate:
        problems.append(f"an expert bias (moe.bias_update_rate={m.bias_update_rate})")
    if config.moe_layer_freq != 1:
        problems.append(f"dense layers between MoE layers (moe_layer_freq={config.moe_layer_freq})")
    if m.score != "softmax":
        problems.append(f"moe.score={m.score!r} ({name}: softmax)")
    if m.expert_groups != 1 or m.routed_scale != 1.0:
        problems.append("group-limited routing or a routed scale (moe.expert_groups, routed_scale)")
    if m.capacity_factor is not None:
        problems.append(f"token dropping (moe.capacity_factor={m.capacity_factor})")
    if m.activation != "swiglu":
        problems.append(f"moe.activation={m.activation!r} ({name}: swiglu)")
    return problems


def check_qwen3_moe(config: DecoderConfig) -> None:
    """Qwen3-MoE: softmax over all experts then top-k; dense layers only first
    (``mlp_only_layers``)."""
    problems = softmax_expert_problems(config, "Qwen3-MoE")
    if config.moe.topk_then_softmax:
        problems.append("topk_then_softmax (Qwen3-MoE: softmax over all experts, then top-k)")
    if problems:
        raise HFInteropError("Qwen3-MoE cannot hold " + "; ".join(problems))


def check_mixtral(config: DecoderConfig) -> None:
    """Mixtral: softmax top-k routing renormalised over the k chosen, MoE in every layer."""
    problems = softmax_expert_problems(config, "Mixtral")
    m = config.moe
    if not (m.topk_then_softmax or (m.norm_topk and m.top_k > 1)):
        problems.append("top-k weights that are not renormalised over the chosen experts")
    if config.first_dense_layers:
        problems.append(f"dense first layers (first_dense_layers={config.first_dense_layers})")
    if problems:
        raise HFInteropError("Mixtral cannot hold " + "; ".join(problems))
