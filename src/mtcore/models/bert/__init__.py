"""The BERT family: a post-LN bidirectional encoder with masked-LM and sentence-pair heads."""

from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.model import IGNORE_INDEX, Bert, Block, build
from mtcore.models.bert.weights import full_weight_shapes, load_full_weights

__all__ = [
    "IGNORE_INDEX",
    "Bert",
    "BertConfig",
    "Block",
    "build",
    "full_weight_shapes",
    "load_full_weights",
]
