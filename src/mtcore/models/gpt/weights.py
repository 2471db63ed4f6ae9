"""Full (unsharded, one-process) GPT weights: their names and shapes, and loading them into
any layout.

"Full weights" are the tensors of ``GPT(config).state_dict()``: whole, named as in one
process (``layers.3.attn.qkv.weight``), with no output copy of a tied embedding. They are
the common currency between checkpoints, HuggingFace import/export and any layout::

    model.load_state_dict(weights)                  # one process
    load_full_weights(build_gpt(config, layout, backend), weights)   # any rank's chunks

The shapes come from the config alone, so a file can be checked before any model is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from mtcore.models.full_weights import check_weight_shapes, load_chunk_weights
from mtcore.models.gpt.config import GPTConfig


def full_weight_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``GPT(config).state_dict()`` (vocab_size set)."""
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    if getattr(config, "moe", None) is not None:
        raise ValueError("full_weight_shapes covers dense models only (model.moe is set)")
    h, f, v, d = config.hidden_size, config.ffn_size, config.vocab_size, config.head_dim
    qkv = (config.num_heads + 2 * config.kv_heads) * d
    fc1 = 2 * f if config.activation == "swiglu" else f
    norm = ("weight",) if config.norm == "rmsnorm" else ("weight", "bias")
    shapes: dict[str, tuple[int, ...]] = {"embed.tok.weight": (v, h)}
    if config.position == "learned":
        shapes["embed.pos"] = (config.seq_len, h)
    for i in range(config.num_layers):
        p = f"layers.{i}"
        linears = {
            "attn.qkv": (qkv, h),
            "attn.proj": (h, config.num_heads * d),
            "mlp.fc1": (fc1, h),
            "mlp.fc2": (h, f),
        }
        for name in ("attn_norm", "mlp_norm"):
            shapes.update({f"{p}.{name}.{t}": (h,) for t in norm})
        for name, shape in linears.items():
            shapes[f"{p}.{name}.weight"] = shape
            if config.bias:
                shapes[f"{p}.{name}.bias"] = (shape[0],)
    shapes.update({f"norm.{t}": (h,) for t in norm})
    if not config.tie_embeddings:
        shapes["output.weight"] = (v, h)
    return shapes


def check_full_weights(config: GPTConfig, weights: Mapping[str, Tensor], what: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor of ``weights``."""
    check_weight_shapes(full_weight_shapes(config), weights, what)


def load_full_weights(chunks: Iterable, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of the full ``weights`` into each of its chunks.

    ``chunks``: what ``build_gpt`` returned on this rank (or ``[GPT(config)]``). A
    pipeline stage without the embedding holds the output copy of a tied embedding;
    it gets ``embed.tok.weight``. Call it on every rank; there is no communication.
    """
    for chunk in chunks:
        source = dict(weights)
        if chunk.output_is_copy and "output.weight" not in source:
            source["output.weight"] = weights["embed.tok.weight"]
        load_chunk_weights(chunk, source)
