"""Full (unsharded, one-process) BERT weights: their names and shapes, and loading them
into any layout.

"Full weights" are the tensors of ``Bert(config).state_dict()``: whole, named as in one
process, without the last pipeline stage's decoder copy of the word embedding. They are
what checkpoints, HuggingFace import/export and every layout exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.names import DECODER_COPY, WORD_EMBEDDING
from mtcore.models.common.full_weights import check_weight_shapes, load_chunk_weights


def full_weight_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``Bert(config).state_dict()`` (vocab_size set)."""
    if config.vocab_size is None:
        raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
    h, f, v = config.hidden_size, config.ffn_size, config.vocab_size
    layer_norm = {"weight": (h,), "bias": (h,)}
    shapes: dict[str, tuple[int, ...]] = {
        WORD_EMBEDDING: (v, h),
        "embed.position": (config.seq_len, h),
        "embed.token_type": (config.type_vocab_size, h),
        **{f"embed.norm.{t}": s for t, s in layer_norm.items()},
    }
    linears = {"attn.qkv": (3 * h, h), "attn.proj": (h, h), "mlp.fc1": (f, h), "mlp.fc2": (h, f)}
    for i in range(config.num_layers):
        for name, shape in linears.items():
            shapes[f"layers.{i}.{name}.weight"] = shape
            if config.bias:
                shapes[f"layers.{i}.{name}.bias"] = (shape[0],)
        for norm in ("attn_norm", "mlp_norm"):
            shapes.update({f"layers.{i}.{norm}.{t}": s for t, s in layer_norm.items()})
    shapes.update({"mlm.dense.weight": (h, h), "mlm.dense.bias": (h,), "mlm.bias": (v,)})
    shapes.update({f"mlm.norm.{t}": s for t, s in layer_norm.items()})
    if config.pair_head:
        shapes.update({"pooler.weight": (h, h), "pooler.bias": (h,)})
        shapes.update({"pair.weight": (2, h), "pair.bias": (2,)})
    return shapes


def check_full_weights(config: BertConfig, weights: Mapping[str, Tensor], what: str) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor of ``weights``."""
    check_weight_shapes(full_weight_shapes(config), weights, what)


def load_full_weights(chunks: Iterable, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of the full ``weights`` into each of its chunks (``build``'s
    chunks, or ``[Bert(config)]``); a decoder copy gets the word embedding. No
    communication: call it on every rank."""
    for chunk in chunks:
        source = dict(weights)
        if chunk.decoder_is_copy:
            source[DECODER_COPY] = weights[WORD_EMBEDDING]
        load_chunk_weights(chunk, source)
