"""The LLaVA family: a CLIP-style ViT and a projector in front of the GPT language model."""

from mtcore.models.vlm.config import LlavaConfig, VisionConfig
from mtcore.models.vlm.model import Llava, build, place_images
from mtcore.models.vlm.vision import Projector, VisionTower

__all__ = [
    "Llava",
    "LlavaConfig",
    "Projector",
    "VisionConfig",
    "VisionTower",
    "build",
    "place_images",
]
