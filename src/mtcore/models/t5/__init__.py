"""The T5 family: an encoder-decoder (v1.1 architecture) trained on span corruption."""

from mtcore.models.t5.config import T5Config
from mtcore.models.t5.model import IGNORE_INDEX, T5, build, messages

__all__ = ["IGNORE_INDEX", "T5", "T5Config", "build", "messages"]
