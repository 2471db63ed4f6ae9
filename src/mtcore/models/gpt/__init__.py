"""The GPT family: decoder-only transformers in Llama and GPT-2 styles, dense or MoE."""

from mtcore.models.gpt.config import STYLES, GPTConfig
from mtcore.models.gpt.family import FAMILY, LMLoader, lm_batches
from mtcore.models.gpt.model import GPT, IGNORE_INDEX, Block, build_gpt
from mtcore.models.gpt.weights import full_weight_shapes, load_full_weights
from mtcore.models.layers import Context, make_context, single_context

__all__ = [
    "FAMILY",
    "GPT",
    "IGNORE_INDEX",
    "STYLES",
    "Block",
    "Context",
    "GPTConfig",
    "LMLoader",
    "build_gpt",
    "full_weight_shapes",
    "lm_batches",
    "load_full_weights",
    "make_context",
    "single_context",
]
