"""Full (unsharded, one-process) GPT weights: their names and shapes, and loading them into
any layout.

"Full weights" are the tensors of ``GPT(config).state_dict()``: whole, named as in one
process (``layers.3.attn.qkv.weight``), with no output copy of a tied embedding. They are
the common currency between checkpoints, HuggingFace import/export and any layout::

    model.load_state_dict(weights)                  # one process
    load_full_weights(build_gpt(config, layout, backend), weights)   # any rank's chunks

The shapes come from the config alone, so a file can be checked before any model is built.
A mixture-of-experts layer's tensors are whole too: ``mlp.experts.fc1`` ``[E, h, n1]``
holds every expert; ``load_full_weights`` keeps this rank's ``E / ep`` of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.full_weights import check_weight_shapes, load_chunk_weights
from mtcore.parallel.layout import Axis
from mtcore.parallel.moe import named_expert_parameters


def full_weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``GPT(config).state_dict()`` (vocab_size set)."""
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    h, v = config.hidden_size, config.vocab_size
    norm = ("weight",) if config.norm == "rmsnorm" else ("weight", "bias")
    shapes: dict[str, tuple[int, ...]] = {"embed.tok.weight": (v, h)}
    if config.position == "learned":
        shapes["embed.pos"] = (config.seq_len, h)
    for i in range(config.num_layers):
        shapes.update(_layer_shapes(config, f"layers.{i}", i))
    for k in range(config.mtp_depth):  # multi-token prediction modules (mtp.py)
        p = f"mtp.{k}"
        shapes.update(
            {f"{p}.{n}.{t}": (h,) for n in ("hidden_norm", "embed_norm", "norm") for t in norm}
        )
        shapes[f"{p}.proj.weight"] = (h, 2 * h)
        shapes.update(_layer_shapes(config, f"{p}.block", config.num_layers + k))
    shapes.update({f"norm.{t}": (h,) for t in norm})
    if not config.tie_embeddings:
        shapes["output.weight"] = (v, h)
    return shapes


def _layer_shapes(config: DecoderConfig, p: str, i: int) -> dict[str, tuple[int, ...]]:
    """Transformer block ``i``'s tensors under the prefix ``p``."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.kv_heads) * d
    norm = ("weight",) if config.norm == "rmsnorm" else ("weight", "bias")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in ("attn_norm", "mlp_norm"):
        shapes.update({f"{p}.{name}.{t}": (h,) for t in norm})
    if config.mla is not None:
        shapes.update(_latent_attention_shapes(config, f"{p}.attn"))
    else:
        attention = {"attn.qkv": (qkv, h), "attn.proj": (h, config.num_heads * d)}
        _linears(shapes, p, attention, config.bias)
    if config.qkv_bias and not config.bias:
        shapes[f"{p}.attn.qkv.bias"] = (qkv,)
    if config.qk_norm:
        shapes.update({f"{p}.attn.{n}.weight": (d,) for n in ("q_norm", "k_norm")})
    if config.is_moe_layer(i):
        shapes.update(_moe_shapes(config, f"{p}.mlp"))
    else:
        _linears(shapes, p, _mlp(h, config.ffn_size, config.activation, "mlp"), config.bias)
    return shapes


def _latent_attention_shapes(config: DecoderConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's projections (no biases) and latent norms."""
    m, h, heads = config.mla, config.hidden_size, config.num_heads
    shapes = {}
    if m.q_lora_rank is None:
        shapes[f"{prefix}.q.weight"] = (heads * m.qk_head_dim, h)
    else:
        shapes[f"{prefix}.q_down.weight"] = (m.q_lora_rank, h)
        shapes[f"{prefix}.q_norm.weight"] = (m.q_lora_rank,)
        shapes[f"{prefix}.q_up.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    shapes[f"{prefix}.kv_down.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
    shapes[f"{prefix}.kv_norm.weight"] = (m.kv_lora_rank,)
    shapes[f"{prefix}.kv_up.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[f"{prefix}.proj.weight"] = (h, heads * m.v_head_dim)
    return shapes


def _mlp(h: int, f: int, activation: str, prefix: str) -> dict[str, tuple[int, int]]:
    fc1 = 2 * f if activation == "swiglu" else f
    return {f"{prefix}.fc1": (fc1, h), f"{prefix}.fc2": (h, f)}


def _linears(shapes: dict, prefix: str, linears: dict, bias: bool) -> None:
    for name, shape in linears.items():
        shapes[f"{prefix}.{name}.weight"] = shape
        if bias:
            shapes[f"{prefix}.{name}.bias"] = (shape[0],)


def _moe_shapes(config: DecoderConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router (weight, expert-bias buffer), routed experts (stored for the
    grouped matmul, ``x @ w``) and shared expert (an ordinary MLP, biased with ``bias``)."""
    m, h = config.moe, config.hidden_size
    fc1 = 2 * m.ffn_size if m.activation == "swiglu" else m.ffn_size
    shapes = {
        f"{prefix}.router.weight": (m.num_experts, h),
        f"{prefix}.router.expert_bias": (m.num_experts,),
        f"{prefix}.experts.fc1": (m.num_experts, h, fc1),
        f"{prefix}.experts.fc2": (m.num_experts, m.ffn_size, h),
    }
    if m.shared_ffn_size:
        _linears(shapes, prefix, _mlp(h, m.shared_ffn_size, m.activation, "shared"), config.bias)
    return shapes


def check_full_weights(config: DecoderConfig, weights: Mapping[str, Tensor], what: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor of ``weights``."""
    check_weight_shapes(full_weight_shapes(config), weights, what)


def load_full_weights(chunks: Iterable, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of the full ``weights`` into each of its chunks.

    ``chunks``: what ``build_gpt`` returned on this rank (or ``[GPT(config)]``). A
    pipeline stage without the embedding holds the output copy of a tied embedding;
    it gets ``embed.tok.weight``. Expert weights: this rank's ``E / ep`` consecutive
    experts (its ep coordinate), then its tp shard; the routers' expert-bias buffers
    are copied whole. Call it on every rank; there is no communication.
    """
    for chunk in chunks:
        source = dict(weights)
        if chunk.output_is_copy and "output.weight" not in source:
            source["output.weight"] = weights["embed.tok.weight"]
        if chunk.mtp_embed is not None:  # multi-token prediction's copy on the last stage
            source["mtp_embed.tok.weight"] = weights["embed.tok.weight"]
        for name, param, (dim, experts) in named_expert_parameters(chunk):
            local = param.shape[dim]
            rank = _ep_rank(chunk, experts // local)
            source[name] = source[name].narrow(dim, rank * local, local)
        load_chunk_weights(chunk, source)
        for name, buffer in chunk.named_buffers():
            if name.endswith("router.expert_bias") and name in weights:
                buffer.copy_(weights[name])


def _ep_rank(chunk, ep: int) -> int:
    layout = chunk.c.layout
    if ep == 1 or layout is None:
        return 0
    return layout.coordinate(Axis.EP)
