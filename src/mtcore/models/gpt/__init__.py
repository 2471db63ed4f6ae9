"""The GPT family: decoder-only transformers in Llama and GPT-2 styles, dense or MoE.

The model is the shared decoder (``mtcore.models.common.decoder``); this folder holds
what makes it a family: its config class, its data pipeline, its HF adapter and the
``ModelFamily`` subclass. The names below are the decoder's, as GPT users import them."""

from mtcore import lazy_exports
from mtcore.models.common.decoder.config import STYLES
from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.family import FAMILY

# The family and its config load with the package (without torch); the model on first use.
_MODEL = {
    "GPT": "mtcore.models.common.decoder.model",
    "IGNORE_INDEX": "mtcore.models.common.decoder.model",
    "Block": "mtcore.models.common.decoder.model",
    "build_gpt": "mtcore.models.common.decoder.model",
    "full_weight_shapes": "mtcore.models.common.decoder.weights",
    "load_full_weights": "mtcore.models.common.decoder.weights",
    "Context": "mtcore.models.common.layers",
    "make_context": "mtcore.models.common.layers",
    "single_context": "mtcore.models.common.layers",
}


__getattr__ = lazy_exports(__name__, _MODEL)


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
