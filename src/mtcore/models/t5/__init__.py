"""The T5 family: an encoder-decoder (v1.1 architecture) trained on span corruption."""

import importlib

from mtcore.models.t5.config import T5Config

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "IGNORE_INDEX": "model",
    "T5": "model",
    "build": "model",
    "messages": "model",
}


def __getattr__(name: str):
    if name in _MODEL:
        return getattr(importlib.import_module(f"{__name__}.{_MODEL[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["IGNORE_INDEX", "T5", "T5Config", "build", "messages"]
