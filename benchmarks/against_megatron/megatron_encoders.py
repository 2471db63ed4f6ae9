"""Megatron-Core's BERT (``BertModel``) and T5 (``T5Model``) on CPU, from the shared shapes.

Where they differ from mtcore's model (Megatron-Core's local spec cannot express it):

* BERT: Megatron-Core's transformer layer is pre-LN (a LayerNorm before attention and
  before the MLP, one after the stack); mtcore's BERT is post-LN, as Devlin et al.
  (LayerNorm after each residual add). Same parameter count and matmuls; exact GELU,
  learned positions, 2 token types, tied MLM decoder, pooler and binary head on both.
  Loss on both: MLM mean over the masked tokens + the pair head's mean.
* T5: both are T5 v1.1 (RMSNorm, no biases, gated tanh-GELU, untied LM head), except
  the positions: mtcore's attention adds T5's relative position bias, Megatron-Core's
  T5 learned absolute positions, because its relative bias reaches the local spec's
  ``DotProductAttention`` as ``attention_bias``, which it refuses (``assert
  attention_bias is None``; only Transformer Engine's attention takes it). mtcore
  does the extra work here. Masks are explicit (cpu_shims 3): none in the encoder
  and across, causal in the decoder. The local block specs name Transformer Engine's
  ``TENorm`` as the encoder's and decoder's final norm, which is None without
  Transformer Engine, so the stacks would end without one; they get the local spec's
  own norm (``WrappedTorchNorm``, here RMSNorm) instead, as T5 has. Both sides draw
  T5's initialisation (``_draw_t5_init``). With Megatron's own (std 0.02 everywhere,
  embeddings too) its T5 stays near ln V on the benchmark's batches and its loss hardly
  depends on the decoder's tokens; word embeddings of std 1 alone make it learn
  (docs/results/megatron.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .configs import DECODER_SEQ, HEADS, HIDDEN, IGNORE_INDEX, LAYERS, SEQ, VOCAB, BenchConfig
from .mtcore_side import ffn_size

_FUSIONS_OFF = dict(
    masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
    gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
)  # fmt: skip


def _config(cfg: BenchConfig, **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=ffn_size(cfg),
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=cfg.tp,
        **_FUSIONS_OFF, **fields,
    )  # fmt: skip


def build_bert(cfg: BenchConfig):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    config = _config(
        cfg, num_layers=LAYERS, normalization="LayerNorm", layernorm_epsilon=1e-12,
        activation_func=F.gelu, add_bias_linear=True,
    )  # fmt: skip
    return BertModel(
        config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
        add_binary_head=True,
    )  # fmt: skip


def bert_forward(model, batch: dict):
    """(per-token MLM losses, pair logits); ``bert_loss`` makes the step's loss."""
    labels = batch["labels"]
    keep = torch.ones_like(batch["tokens"])  # no padding
    lm_loss, pair_logits = model(
        batch["tokens"], keep, tokentype_ids=batch["token_types"], lm_labels=labels.clamp(min=0)
    )
    return lm_loss, pair_logits


def bert_loss(output, batch: dict) -> torch.Tensor:
    lm_loss, pair_logits = output
    masked = (batch["labels"] != IGNORE_INDEX).float()
    mlm = (lm_loss.float() * masked).sum() / masked.sum().clamp(min=1)
    return mlm + F.cross_entropy(pair_logits.float(), batch["pair_labels"])


def build_t5(cfg: BenchConfig, t5_init: bool = True):
    """``t5_init=False``: Megatron's own initialisation (bench_megatron_t5_init.py)."""
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    half = LAYERS // 2
    encoder = get_t5_encoder_with_local_block_spec(half)
    decoder = get_t5_decoder_with_local_block_spec(half)
    encoder.layer_norm = decoder.layer_norm = WrappedTorchNorm  # the final norms
    fields = dict(
        num_layers=half, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=lambda x: F.gelu(x, approximate="tanh"),
        add_bias_linear=False,
    )  # fmt: skip
    model = T5Model(
        _config(cfg, **fields), _config(cfg, **fields), encoder, decoder, vocab_size=VOCAB,
        max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )  # fmt: skip
    if t5_init:
        _draw_t5_init(model, cfg.tp)
    return model


def _draw_t5_init(model, tp: int) -> None:
    """T5's initialisation, as mtcore's T5 draws it (HF's), on Megatron's T5: word
    embeddings std 1; every linear weight std ``fan_in ** -0.5`` (key, value, output,
    MLP and LM head as T5; T5's query std ``(h d) ** -0.5`` without a ``d ** -0.5``
    logit scale is this std with Megatron's scale); the absolute positions, which
    mtcore's T5 does not have, std 0.02. Each tp rank draws its own shard."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for index, (name, weight) in enumerate(model.named_parameters()):
            if weight.dim() != 2:
                continue  # norms stay 1
            generator = torch.Generator().manual_seed(1000 * index + rank)
            if name.endswith("word_embeddings.weight"):
                std = 1.0
            elif name.endswith("position_embeddings.weight"):
                std = 0.02
            else:
                split_inputs = getattr(weight, "partition_dim", 0) == 1  # row parallel
                std = (weight.shape[1] * (tp if split_inputs else 1)) ** -0.5
            weight.normal_(0.0, std, generator=generator)


_DECODER_CAUSAL = torch.triu(torch.ones(DECODER_SEQ, DECODER_SEQ, dtype=torch.bool), 1)


def t5_forward(model, batch: dict):
    """Per-token losses ``[b, decoder seq]``."""
    b = batch["tokens"].shape[0]
    encoder_mask = torch.zeros(b, 1, SEQ, SEQ, dtype=torch.bool)
    cross_mask = torch.zeros(b, 1, DECODER_SEQ, SEQ, dtype=torch.bool)
    decoder_mask = _DECODER_CAUSAL[None, None].expand(b, 1, -1, -1)
    return model(
        batch["tokens"], batch["decoder_tokens"], encoder_mask, decoder_mask, cross_mask,
        lm_labels=batch["labels"],
    )  # fmt: skip
