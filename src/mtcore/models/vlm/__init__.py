"""The LLaVA family: a CLIP-style ViT and a projector in front of the GPT language model."""

import importlib

from mtcore.models.vlm.config import LlavaConfig, VisionConfig

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "Llava": "model",
    "build": "model",
    "place_images": "model",
    "Projector": "vision",
    "VisionTower": "vision",
}


def __getattr__(name: str):
    if name in _MODEL:
        return getattr(importlib.import_module(f"{__name__}.{_MODEL[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Llava",
    "LlavaConfig",
    "Projector",
    "VisionConfig",
    "VisionTower",
    "build",
    "place_images",
]
