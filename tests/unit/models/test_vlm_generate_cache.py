"""LLaVA generation with the KV cache: the prompt with its image fills the cache once,
and the tokens equal the uncached loop's (greedy and top-k), up to ``seq_len``."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models import parse_model_config
from mtcore.models.common.layers import single_context
from mtcore.models.vlm import Llava

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(
    family="llava", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=24,
    vocab_size=64, init_std=0.3,
    vision=dict(image_size=8, patch_size=4, hidden_size=16, num_layers=1, num_heads=2),
)  # fmt: skip


def test_cached_llava_generation_equals_the_uncached_loop():
    config = parse_model_config(SMALL)
    model = Llava(config, single_context(config, select_backend("cpu"))).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 60, (1, 10), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 2 : 2 + config.image_tokens] = True
    batch = {
        "tokens": tokens,
        "image_mask": mask,
        "pixel_values": torch.randn(1, 1, 3, 8, 8, generator=g),
    }
    cached = model.generate(batch, 20)  # stops at seq_len: 14 new tokens
    assert cached.shape == (1, 24) and len(set(cached[0, 10:].tolist())) > 1
    assert torch.equal(cached, model.generate(batch, 20, use_cache=False))
    other = {**batch, "pixel_values": batch["pixel_values"] + 1}
    assert not torch.equal(model.generate(other, 20), cached)  # the image is read
    sampled = [
        model.generate(batch, 8, top_k=5, generator=torch.Generator().manual_seed(1), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(*sampled)
