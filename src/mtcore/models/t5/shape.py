"""T5's shape for the planner (``ModelFamily.shape``)."""

from __future__ import annotations

from mtcore.models.shape import Block, ModelShape, planned_vocab


def t5_shape(config) -> ModelShape:
    """The encoder's blocks, then the decoder's (self- and cross-attention), over the
    model's own pipeline split (``stage_counts``)."""
    h, v = config.hidden_size, planned_vocab(config)
    se, sd = config.seq_len, config.decoder_seq_len
    common = dict(
        hidden=h,
        heads=config.num_heads,
        kv_heads=config.num_heads,
        head_dim=config.kv_dim,
        ffn=config.ffn_size,
        gated=True,
        dropout=config.dropout > 0,
        biased_attention=True,  # the relative position bias: fp32 scores outside the kernel
    )
    encoder = [Block(seq=se, kv_seq=se, **common)] * config.encoder_layers
    decoder = [Block(seq=sd, kv_seq=sd, cross_seq=se, **common)] * config.decoder_layers
    return ModelShape(
        family=config.family,
        blocks=tuple(encoder + decoder),
        vocab=v,
        hidden=h,
        seq_len=se,
        head_seq=sd,
        embed_params=v * h,
        head_params=0 if config.tie_embeddings else v * h,
        head_dense=0,
        tied=config.tie_embeddings,
        recompute=config.recompute,
        total_params=config.num_params(),
        stage_counts=config.stage_counts,
    )
