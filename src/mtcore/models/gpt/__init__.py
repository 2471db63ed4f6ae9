"""The GPT family: decoder-only transformers in Llama and GPT-2 styles, dense or MoE.

The model is the shared decoder (``mtcore.models.common.decoder``); this folder holds
what makes it a family: its config class, its data pipeline, its HF adapter and the
``ModelFamily`` subclass. The names below are the decoder's, as GPT users import them."""

from mtcore.models.common.decoder.config import STYLES
from mtcore.models.common.decoder.model import GPT, IGNORE_INDEX, Block, build_gpt
from mtcore.models.common.decoder.weights import full_weight_shapes, load_full_weights
from mtcore.models.common.layers import Context, make_context, single_context
from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.family import FAMILY

__all__ = [
    "FAMILY",
    "GPT",
    "IGNORE_INDEX",
    "STYLES",
    "Block",
    "Context",
    "GPTConfig",
    "build_gpt",
    "full_weight_shapes",
    "load_full_weights",
    "make_context",
    "single_context",
]
