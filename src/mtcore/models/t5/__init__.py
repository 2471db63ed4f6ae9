"""The T5 family: an encoder-decoder (v1.1 architecture) trained on span corruption."""

from mtcore import lazy_exports
from mtcore.models.t5.config import T5Config

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "IGNORE_INDEX": ".model",
    "T5": ".model",
    "build": ".model",
    "messages": ".model",
}


__getattr__ = lazy_exports(__name__, _MODEL)


__all__ = ["IGNORE_INDEX", "T5", "T5Config", "build", "messages"]
