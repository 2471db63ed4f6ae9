"""BERT's shape for the planner (``ModelFamily.shape``)."""

from __future__ import annotations

from mtcore.models.shape import Block, ModelShape, even_counts, planned_vocab


def bert_shape(config) -> ModelShape:
    """Post-LN encoder blocks; word, position and type embeddings; the MLM head's dense."""
    h, s, v = config.hidden_size, config.seq_len, planned_vocab(config)
    block = Block(
        seq=s,
        kv_seq=s,
        hidden=h,
        heads=config.num_heads,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        ffn=config.ffn_size,
        gated=False,
        dropout=config.dropout > 0,
    )
    return ModelShape(
        family=config.family,
        blocks=(block,) * config.num_layers,
        vocab=v,
        hidden=h,
        seq_len=s,
        head_seq=s,
        embed_params=(v + s + config.type_vocab_size) * h,
        head_params=h * h,
        head_dense=h,
        tied=True,
        recompute=config.recompute,
        total_params=config.num_params(),
        stage_counts=even_counts(config.num_layers),
    )
