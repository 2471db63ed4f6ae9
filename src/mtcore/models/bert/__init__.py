"""The BERT family: a post-LN bidirectional encoder with masked-LM and sentence-pair heads."""

from mtcore import lazy_exports
from mtcore.models.bert.config import BertConfig

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "IGNORE_INDEX": ".model",
    "Bert": ".model",
    "Block": ".model",
    "build": ".model",
    "full_weight_shapes": ".weights",
    "load_full_weights": ".weights",
}


__getattr__ = lazy_exports(__name__, _MODEL)


__all__ = [
    "IGNORE_INDEX",
    "Bert",
    "BertConfig",
    "Block",
    "build",
    "full_weight_shapes",
    "load_full_weights",
]
