"""Models built from mtcore's parallel layers: GPT (Llama and GPT-2 styles)."""

from mtcore.models.config import STYLES, ModelConfig
from mtcore.models.full_weights import full_weight_shapes, load_full_weights
from mtcore.models.gpt import GPT, IGNORE_INDEX, build_gpt, make_context, single_context
from mtcore.models.layers import Block, Context

__all__ = [
    "GPT",
    "IGNORE_INDEX",
    "STYLES",
    "Block",
    "Context",
    "ModelConfig",
    "build_gpt",
    "full_weight_shapes",
    "load_full_weights",
    "make_context",
    "single_context",
]
