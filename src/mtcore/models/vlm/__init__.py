"""The LLaVA family: a CLIP-style ViT and a projector in front of the GPT language model."""

from mtcore import lazy_exports
from mtcore.models.vlm.config import LlavaConfig, VisionConfig

# The config loads with the package (without torch); the model on first use.
_MODEL = {
    "Llava": ".model",
    "build": ".model",
    "place_images": ".model",
    "Projector": ".vision",
    "VisionTower": ".vision",
}


__getattr__ = lazy_exports(__name__, _MODEL)


__all__ = [
    "Llava",
    "LlavaConfig",
    "Projector",
    "VisionConfig",
    "VisionTower",
    "build",
    "place_images",
]
