"""The HF ``model_type`` values the decoder imports, and the architecture each exports as:
a family declares them (``HFAdapter.model_types``) without loading the adapter (torch)."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
