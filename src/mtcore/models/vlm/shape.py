"""LLaVA's shape for the planner (``ModelFamily.shape``)."""

from __future__ import annotations

from dataclasses import replace

from mtcore.models.common.decoder.shape import decoder_shape
from mtcore.models.shape import Block, ModelShape, even_counts


def llava_shape(config) -> ModelShape:
    """LLaVA: the vision tower's ViT blocks, then the GPT's, the tower on the first stage.

    Each sample carries ``images.max_images`` image slots (unused ones are computed
    too), and each image is one sequence of patches (plus the class token) through
    the tower: a tower block has ``seq = max_images x tower tokens`` queries, each
    attending to one image's ``kv_seq`` tokens. The language model's ``seq_len``
    already counts the image tokens. The patch embedding, positions and projector
    are replicated over tp (``first_stage_params``, their products
    ``first_stage_flops``).
    """
    v = config.vision
    language = decoder_shape(config)
    frozen_vision, frozen_language = config.frozen("vision"), config.frozen("language")
    tower = Block(
        seq=config.images.max_images * v.seq_len,
        kv_seq=v.seq_len,
        hidden=v.hidden_size,
        heads=v.num_heads,
        kv_heads=v.kv_heads,
        head_dim=v.head_dim,
        ffn=v.ffn_size,
        gated=False,
        dropout=False,
        backward="none" if frozen_vision else "full",  # a frozen tower runs under no_grad
        cp_split=False,  # every cp rank runs the tower on every image
    )
    # A frozen language model still passes the gradient back to the projector (LLaVA's
    # stage 1); a whole frozen front is refused by the config.
    lm_backward = "input" if frozen_language else "full"
    h = v.hidden_size
    embedding = v.channels * v.patch_size**2 * h + (h if v.patch_bias else 0)
    embedding += v.seq_len * h + (h if v.class_token else 0) + (2 * h if v.pre_norm else 0)
    projector = config.projector_params()
    vision_params = embedding  # the blocks' biases and norms are left out, as for the GPT's
    frozen = (vision_params if frozen_vision else 0) + (
        projector if config.frozen("projector") else 0
    )
    # The patch embedding's and projector's products, per sequence: 3 passes trained, 2
    # frozen but passing the gradient back to a trained part before them, 1 under no_grad.
    images = config.images.max_images
    patch = images * v.seq_len * 2.0 * v.channels * v.patch_size**2 * h
    patch *= 1 if frozen_vision else 3
    projector_passes = 3 if not config.frozen("projector") else 1 if frozen_vision else 2
    projector_flops = images * v.num_features * 2.0 * projector * projector_passes
    split = even_counts(config.num_layers)

    def counts(pp: int, vpp: int, first: int | None = None, last: int | None = None) -> list[int]:
        out = list(split(pp, vpp, first, last))
        out[0] += v.num_layers  # the tower sits on virtual stage 0, before the first layers
        return out

    return replace(
        language,
        blocks=(tower,) * v.num_layers
        + tuple(replace(b, backward=lm_backward) for b in language.blocks),
        stage_counts=counts,
        first_stage_params=vision_params + projector,
        first_stage_frozen=frozen,
        first_stage_flops=patch + projector_flops,
        embed_frozen=frozen_language,
    )
