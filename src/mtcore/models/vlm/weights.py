"""Full (one-process) LLaVA weights: their names and shapes, and loading them into any
layout.

The names are ``Llava(config).state_dict()``'s: the GPT's (``embed.tok.weight``,
``layers.i...``, ``norm.weight``, ``output.weight``), then ``vision.*`` and
``projector.*``. The shapes come from the config alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.decoder.weights import full_weight_shapes as decoder_weight_shapes
from mtcore.models.common.full_weights import check_weight_shapes, load_chunk_weights
from mtcore.models.vlm.config import LlavaConfig


def language_config(config: LlavaConfig) -> DecoderConfig:
    """The language model alone, as the shared decoder's config (for its HF mapping)."""
    return DecoderConfig(**{k: getattr(config, k) for k in DecoderConfig.model_fields})


def full_weight_shapes(config: LlavaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``Llava(config).state_dict()`` (vocab_size set)."""
    shapes = decoder_weight_shapes(language_config(config))
    v, h = config.vision, config.vision.hidden_size
    shapes["vision.embed.weight"] = (h, v.channels * v.patch_size**2)
    if v.patch_bias:
        shapes["vision.embed.bias"] = (h,)
    if v.class_token:
        shapes["vision.embed.cls"] = (h,)
    shapes["vision.embed.pos"] = (v.seq_len, h)
    if v.pre_norm:
        shapes.update({"vision.pre_norm.weight": (h,), "vision.pre_norm.bias": (h,)})
    for i in range(v.num_layers):
        p = f"vision.layers.{i}"
        for name, shape in {
            "attn.qkv": (3 * h, h), "attn.proj": (h, h), "mlp.fc1": (v.ffn_size, h),
            "mlp.fc2": (h, v.ffn_size),
        }.items():  # fmt: skip
            shapes[f"{p}.{name}.weight"], shapes[f"{p}.{name}.bias"] = shape, (shape[0],)
        for name in ("attn_norm", "mlp_norm"):
            shapes[f"{p}.{name}.weight"] = shapes[f"{p}.{name}.bias"] = (h,)
    shapes["projector.fc1.weight"], shapes["projector.fc1.bias"] = (
        (config.hidden_size, h),
        (config.hidden_size,),
    )
    if config.projector == "mlp2x_gelu":
        hl = config.hidden_size
        shapes["projector.fc2.weight"], shapes["projector.fc2.bias"] = (hl, hl), (hl,)
    return shapes


def check_full_weights(config: LlavaConfig, weights: Mapping[str, Tensor], what: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor."""
    check_weight_shapes(full_weight_shapes(config), weights, what)


def load_full_weights(chunks: Iterable, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of the full ``weights`` into each of its chunks (a tied
    output copy on a stage without the embedding gets ``embed.tok.weight``)."""
    for chunk in chunks:
        source = dict(weights)
        if getattr(chunk, "output_is_copy", False):
            source["output.weight"] = weights["embed.tok.weight"]
        load_chunk_weights(chunk, source)
