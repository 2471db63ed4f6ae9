"""The BERT family: a post-LN bidirectional encoder with masked-LM and sentence-pair heads."""

import importlib

from mtcore.models.bert.config import BertConfig

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "IGNORE_INDEX": "model",
    "Bert": "model",
    "Block": "model",
    "build": "model",
    "full_weight_shapes": "weights",
    "load_full_weights": "weights",
}


def __getattr__(name: str):
    if name in _MODEL:
        return getattr(importlib.import_module(f"{__name__}.{_MODEL[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX",
    "Bert",
    "BertConfig",
    "Block",
    "build",
    "full_weight_shapes",
    "load_full_weights",
]
