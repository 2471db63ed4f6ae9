"""The GPT's shape for the planner (``ModelFamily.shape``)."""

from __future__ import annotations

from mtcore.models.shape import Block, Latent, ModelShape, even_counts, planned_vocab


def decoder_shape(config) -> ModelShape:
    """The decoder-only transformer's blocks (dense or MoE), embedding and head."""
    h, s, v = config.hidden_size, config.seq_len, planned_vocab(config)
    moe = config.moe
    blocks = []
    depth = config.mtp_depth  # each prediction module: a block after two norms and W_k
    for i in range(config.num_layers + depth):
        common = dict(
            seq=s,
            kv_seq=s,
            hidden=h,
            heads=config.num_heads,
            kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            gated=config.activation == "swiglu",
            dropout=config.dropout > 0,
        )
        if config.mla is not None:
            common.update(_latent_widths(config.mla, config.num_heads))
        if config.is_moe_layer(i):
            blocks.append(
                Block(
                    **{**common, "gated": moe.activation == "swiglu"},
                    ffn=0,
                    experts=moe.num_experts,
                    top_k=moe.top_k,
                    expert_ffn=moe.ffn_size,
                    shared_ffn=moe.shared_ffn_size,
                )
            )
        else:
            blocks.append(Block(**common, ffn=config.ffn_size))
    positions = s * h if config.position == "learned" else 0
    return ModelShape(
        family=config.family,
        blocks=tuple(blocks[: config.num_layers]),
        vocab=v,
        hidden=h,
        seq_len=s,
        head_seq=s,
        embed_params=v * h + positions,
        head_params=0 if config.tie_embeddings else v * h,
        head_dense=0,
        tied=config.tie_embeddings,
        recompute=config.recompute,
        total_params=config.num_params(),
        stage_counts=even_counts(config.num_layers),
        last_blocks=tuple(blocks[config.num_layers :]),
        last_stage_params=depth * (2 * h * h + 3 * h),
        head_passes=1 + depth,
    )


def _latent_widths(mla, heads: int) -> dict:
    """A latent-attention block's fields: its widths, and the attention kernel's head
    size (queries/keys and values padded to the wider of the two)."""
    latent = Latent(
        q_rank=mla.q_lora_rank or 0,
        kv_rank=mla.kv_lora_rank,
        nope=mla.qk_nope_head_dim,
        rope=mla.qk_rope_head_dim,
        v_dim=mla.v_head_dim,
    )
    return dict(kv_heads=heads, head_dim=max(latent.qk_dim, latent.v_dim), latent=latent)
