"""Random tiny transformers LLaVAs and matching inputs, for the HF interop tests (the
unit tests and the tp2 x pp2 one in tests/distributed)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

IMAGE_ID, VOCAB, SEQ = 5, 64, 16


def hf_llava(
    layers: int = 3,
    feature_layer: int = -2,
    strategy: str = "default",
    seed: int = 0,
    image_id: int = IMAGE_ID,
):
    """A random tiny transformers LLaVA (CLIP 8 px / 4 px patches, Llama 2 layers) that
    marks images with token ``image_id`` (``image_token_index``)."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        image_size=8, patch_size=4, projection_dim=8, hidden_act="quick_gelu", initializer_range=0.2,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        initializer_range=0.1,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id,
        image_seq_length=4 + (strategy == "full"), vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # LayerNorms and RMSNorms away from their identity init
                p.copy_(
                    1 + 0.2 * torch.randn_like(p)
                    if name.endswith("weight")
                    else 0.1 * torch.randn_like(p)
                )
    return model


def inputs(image_tokens: int = 4) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(mtcore batch, HF input_ids, HF pixel_values): sample 0 has one image, sample 1 two."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(IMAGE_ID + 1, VOCAB, (2, SEQ), generator=g)
    ids[:, 2 : 2 + image_tokens] = IMAGE_ID
    ids[1, 8 : 8 + image_tokens] = IMAGE_ID
    pixels = torch.randn(3, 3, 8, 8, generator=g)
    slots = torch.zeros(2, 2, 3, 8, 8)
    slots[0, 0], slots[1, 0], slots[1, 1] = pixels
    return {"tokens": ids, "image_mask": ids == IMAGE_ID, "pixel_values": slots}, ids, pixels
