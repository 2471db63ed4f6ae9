"""The LLaVA family in one process: config checks, the patch embedding, image placement,
freezing, generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.models import FamilyError, family_names, get_family, parse_model_config
from mtcore.models.common.layers import single_context
from mtcore.models.vlm import Llava, LlavaConfig, place_images
from mtcore.models.vlm.vision import quick_gelu
from mtcore.parallel.layout import LayoutError, LayoutSpec

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(
    family="llava", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=24,
    vocab_size=64, vision=dict(image_size=8, patch_size=4, hidden_size=16, num_layers=1, num_heads=2),
)  # fmt: skip


def _config(**changes) -> LlavaConfig:
    return parse_model_config({**SMALL, **changes})


def _model(config: LlavaConfig) -> Llava:
    return Llava(config, single_context(config, select_backend("cpu")))


def _batch(config: LlavaConfig, b: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 60, (b, config.seq_len), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 3 : 3 + config.image_tokens] = True
    labels = tokens.roll(-1, 1).masked_fill(mask, -100)
    pixels = torch.randn(b, 1, 3, 8, 8, generator=g)
    return {"tokens": tokens, "labels": labels, "image_mask": mask, "pixel_values": pixels}


def test_llava_is_a_builtin_family():
    assert "llava" in family_names()
    config = _config()
    assert isinstance(config, LlavaConfig) and config.image_tokens == 4
    assert get_family("llava").metric_names(config) == ("caption_accuracy",)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(freeze=["vision", "projector", "language"]), "nothing would train"),
        (dict(vision={**SMALL["vision"], "image_size": 10}), "not divisible by vision.patch_size"),
        (dict(vision={**SMALL["vision"], "colour": 1}), "unknown config key 'model.vision.colour'"),
        (dict(freeze=["eyes"]), "model.freeze.0"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(changes, message):
    with pytest.raises(FamilyError, match=message):
        _config(**changes)


def test_layouts_the_model_cannot_take_are_refused():
    config = _config()
    config.check_layout(LayoutSpec(cp=2))  # image tokens are positions of the split
    with pytest.raises(LayoutError, match=r"sequence length 26 is not divisible by 2\*cp = 2\*2"):
        _config(seq_len=26).check_layout(LayoutSpec(cp=2))
    odd = _config(vision={**SMALL["vision"], "num_heads": 1})
    with pytest.raises(LayoutError, match=r"vision\.num_heads=1 is not divisible by tp=2"):
        odd.check_layout(LayoutSpec(tp=2))
    config.check_layout(LayoutSpec(tp=2, pp=2, sequence_parallel=True))


def test_the_patch_embedding_is_a_strided_convolution():
    model = _model(_config())
    embed = model.vision.embed
    pixels = torch.randn(3, 3, 8, 8)
    kernel = embed.weight.view(16, 3, 4, 4)
    conv = F.conv2d(pixels, kernel, stride=4).flatten(2).transpose(1, 2)  # [n, patches, h]
    got = embed(pixels)
    assert got.shape == (3, 5, 16)  # class token + 4 patches
    torch.testing.assert_close(got[:, 1:], conv + embed.pos[1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 0], (embed.cls + embed.pos[0]).expand(3, -1))


def test_images_go_to_their_positions_in_order():
    x = torch.zeros(2, 6, 1)
    features = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])[..., None]
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out = place_images(x, features, mask, 0)[..., 0]
    assert out.tolist() == [[0, 1, 2, 0, 3, 4], [0] * 6]
    shard = place_images(torch.zeros(2, 3, 1), features, mask, 3)[..., 0]  # a sequence shard
    assert shard.tolist() == [[0, 3, 4], [0, 0, 0]]


def test_the_image_changes_the_logits_after_it_only():
    """Causal: positions before the image do not see it, positions after do."""
    config = _config()
    model = _model(config)
    batch = _batch(config)
    other = {**batch, "pixel_values": batch["pixel_values"] + 1}
    a, b = model(batch), model(other)
    assert torch.equal(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


@pytest.mark.parametrize("freeze", [("vision",), ("vision", "language"), ("projector",)])
def test_frozen_parts_get_no_gradient(freeze):
    config = _config(freeze=list(freeze))
    model = _model(config)
    batch = _batch(config)
    total, count = model.loss({"logits": model(batch)}, batch)["lm"]
    (total / count).backward()
    for name, p in model.named_parameters():
        frozen = Llava.part_of(name) in freeze
        assert p.requires_grad is not frozen, name
        assert (p.grad is None) is frozen, name
    assert any(n.startswith("projector.") for n, _ in model.named_parameters())


def test_quick_gelu_is_clips():
    x = torch.linspace(-4, 4, 9)
    assert torch.allclose(quick_gelu(x), x * torch.sigmoid(1.702 * x))


def test_generate_appends_tokens_and_stops_at_the_end_token():
    config = _config()
    model = _model(config).eval()
    batch = {k: v[:1, :10] for k, v in _batch(config).items() if k != "labels"}
    batch["pixel_values"] = _batch(config)["pixel_values"][:1]
    out = model.generate(batch, 5)
    assert out.shape == (1, 15) and torch.equal(out[:, :10], batch["tokens"])
    first = int(out[0, 10])
    stopped = model.generate(batch, 5, stop_id=first)
    assert stopped.shape == (1, 11)
