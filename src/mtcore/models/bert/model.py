"""BERT: a bidirectional transformer encoder pre-trained with a masked LM and a
sentence-pair task (Devlin et al. 2019, arXiv 1810.04805; Megatron-Core's BertModel).

One class serves the whole model and each pipeline chunk of it, as the GPT does: a
``Bert`` holds the encoder blocks ``layers`` (keyed by their global index) and, on the
first chunk, the embeddings, on the last, the heads. Parameter names are the whole
model's at any layout (``layers.7.mlp.fc1.weight``)::

    model = Bert(config)                          # one process
    mlm_logits, pair_logits = model(tokens, token_types, padding_mask)
    built = build(config, layout, backend, seed)  # this rank's chunks

Every weight is drawn on the host from a generator seeded by (seed, module name),
whole, then sliced for tp: any layout starts from the same numbers as one process.

Tensor parallelism splits the heads, the feed-forward and the vocabulary (the word
embedding, the decoder and its bias: MLM logits stay ``[b, s, V/tp]`` and the loss and
accuracy are computed without gathering them). Under sequence parallelism the hidden
states between blocks are sequence shards ``[b, s/tp, h]``: each rank adds the position
and token-type embeddings of its own positions, the LayerNorms and the MLM transform
run on the shard, and the pooler gathers just the first position of each shard.
Under context parallelism each cp rank holds two of ``2 * cp`` chunks of every
sequence (``mtcore.parallel.context``): the padding mask is gathered over cp once
per stage, and [CLS] (cp rank 0's first token) is broadcast to every cp rank,
which all run the pair head (its loss counted once per cp rank, as the engine's
token weighting over dp x cp expects).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.names import DECODER_COPY
from mtcore.models.common.chunks import PipelineChunk, build_chunks
from mtcore.models.common.layers import MLP, Attention, Context, Norm
from mtcore.models.family import BuiltModel
from mtcore.parallel.context import broadcast_from_first, gather_key_mask
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    TPPartition,
    VocabParallelEmbedding,
    column_parallel_matmul,
    gather_from_sp,
    mark_sequence_parallel,
    normal_init,
    set_tp_partition,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from mtcore.precision.fp8 import FP8Recipe

IGNORE_INDEX = -100


def _drawn(c: Context, name: str, shape: tuple[int, ...]) -> nn.Parameter:
    """A replicated parameter drawn ``N(0, init_std^2)`` from the generator of ``name``."""
    weight = torch.empty(shape)
    normal_init(c.config.init_std)(weight, c.generator(name))
    return nn.Parameter(weight.to(c.device))


class Dense(nn.Module):
    """A replicated linear layer (pooler, MLM transform, pair head): small, so every tp
    rank computes all of it. ``sp``: it sees a sequence shard, so its
    gradients are partial sums over tp."""

    def __init__(
        self, c: Context, name: str, in_features: int, out_features: int, sp: bool = False
    ):
        super().__init__()
        self.weight = _drawn(c, name, (out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features, device=c.device))
        if sp:
            mark_sequence_parallel(self, "weight")
            mark_sequence_parallel(self, "bias")

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Embeddings(nn.Module):
    """Word (vocabulary split over tp) + token-type + learned position embeddings,
    then LayerNorm and dropout."""

    def __init__(self, c: Context):
        super().__init__()
        cfg, self.c = c.config, c
        self.word = VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            c.tp,
            sequence_parallel=c.sequence_parallel,
            init_method=normal_init(cfg.init_std),
            generator=c.generator("embed.word"),
            device=c.device,
        )
        self.position = _drawn(c, "embed.position", (cfg.seq_len, cfg.hidden_size))
        self.token_type = _drawn(c, "embed.token_type", (cfg.type_vocab_size, cfg.hidden_size))
        if c.sequence_parallel:  # each rank adds only its positions' rows
            mark_sequence_parallel(self, "position")
            mark_sequence_parallel(self, "token_type")
        self.norm = Norm(c)

    def forward(self, tokens: Tensor, token_types: Tensor | None) -> Tensor:
        x = self.word(tokens)  # [b, s, h], or [b, s / tp, h] under sequence parallel
        s, start = x.shape[1], 0
        if self.c.sequence_parallel:
            start = self.c.tp.rank * s
        if token_types is None:
            token_types = torch.zeros_like(tokens)
        types = F.embedding(token_types[:, start : start + s], self.token_type)
        position = self.position[self.c.positions(start, s)]  # global positions under cp
        x = x + types.to(x.dtype) + position.to(x.dtype)
        return self.c.dropout(self.norm(x), self.training)


class Block(nn.Module):
    """Post-LN encoder block (BERT's): x = norm(x + attn(x)), then x = norm(x + mlp(x)).

    Attention is bidirectional; ``padding_mask`` (bool ``[b, s]``, True = a real token)
    hides the padding keys.
    """

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        g = c.generator(f"layers.{index}")
        self.attn, self.attn_norm = Attention(c, g, causal=False), Norm(c)
        self.mlp, self.mlp_norm = MLP(c, g), Norm(c)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        attended = self.attn(x, key_padding_mask=padding_mask)
        x = self.attn_norm(x + self.c.dropout(attended, self.training))
        return self.mlp_norm(x + self.c.dropout(self.mlp(x), self.training))


class MaskedLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder: the word embedding's weight (tied)
    with a bias of its own, both split over the vocabulary.

    ``copy``: this pipeline stage lacks the embedding, so the decoder weight is a copy
    drawn from the embedding's generator (equal at init); the trainer keeps the two
    equal by summing their gradients (``Bert.tied_copies``).
    """

    def __init__(self, c: Context, copy: bool):
        super().__init__()
        cfg, self.c = c.config, c
        h, sp = cfg.hidden_size, c.sequence_parallel
        self.dense, self.norm = Dense(c, "mlm.dense", h, h, sp), Norm(c)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size // c.tp.size, device=c.device))
        set_tp_partition(self, "bias", TPPartition(0, (cfg.vocab_size,)))
        self.decoder = None
        if copy:
            self.decoder = ColumnParallelLinear(
                h,
                cfg.vocab_size,
                c.tp,
                bias=False,
                sequence_parallel=sp,
                init_method=normal_init(cfg.init_std),
                generator=c.generator("embed.word"),
                device=c.device,
            )
            # The gradient norm counts a tied weight once, on the embedding's stage.
            self.decoder.weight.pipeline_copy = True

    def forward(self, x: Tensor, word_weight: Tensor | None) -> Tensor:
        """``[b, s(/tp), h]`` -> logits ``[b, s, V/tp]`` (the sequence gathered under sp)."""
        x = self.norm(F.gelu(self.dense(x)))
        weight = word_weight if self.decoder is None else self.decoder.weight
        return column_parallel_matmul(x, weight, self.bias, self.c.tp, self.c.sequence_parallel)


class Bert(PipelineChunk):
    """The whole model (default) or one pipeline chunk: ``layers`` with or without the
    embeddings (``first``) and the heads (``last``)."""

    def __init__(
        self,
        config: BertConfig,
        context: Context | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__(config, context, layers, first, last, Embeddings, Block)
        c = self.c
        self.mlm = MaskedLMHead(c, copy=not first) if last else None
        self.pooler = self.pair = None
        if last and config.pair_head:
            h = config.hidden_size
            self.pooler, self.pair = Dense(c, "pooler", h, h), Dense(c, "pair", h, 2)

    @property
    def decoder_is_copy(self) -> bool:
        return self.mlm is not None and self.mlm.decoder is not None

    def forward(
        self, tokens: Tensor, token_types: Tensor | None = None, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The whole model: ``(mlm_logits [b, s, V/tp], pair_logits [b, 2] or None)``."""
        if not (self.first and self.last):
            raise ValueError("forward() runs the whole model; a pipeline chunk runs stage()")
        batch = {"tokens": tokens, "token_types": token_types, "padding_mask": padding_mask}
        out = self.stage({}, batch)
        return out["mlm_logits"], out.get("pair_logits")

    def encode(self, x: Tensor, padding_mask: Tensor | None) -> Tensor:
        """This chunk's blocks over the hidden states ``x``."""
        for block in self.layers.values():
            if self.config.recompute == "full":
                x = checkpoint(
                    block, x, padding_mask, backend=self.c.backend, tracker=self.c.tracker
                )
            else:
                x = block(x, padding_mask)
        return x

    def pooled(self, x: Tensor) -> Tensor:
        """tanh(dense(hidden state of [CLS], position 0)) ``[b, h]``."""
        if self.c.sequence_parallel:
            # Each shard's first position, gathered; shard 0's is [CLS]. The pooler
            # runs replicated, so each rank's gradient is already whole (no reduction).
            first = gather_from_sp(x[:, :1], self.tp, reduce_grad=False)[:, 0]
        else:
            first = x[:, 0]
        if self.c.cp is not None:  # [CLS] is cp rank 0's; every cp rank runs the pair head
            first = broadcast_from_first(first, self.c.cp)
        return torch.tanh(self.pooler(first))

    # -- the pipeline-stage contract (mtcore.models.family) --------------------------
    def stage(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch["tokens"]`` (and ``token_types``) on the first stage, ``{"hidden"}``
        on the others -> ``{"hidden"}`` for the next stage, or on the last
        ``{"mlm_logits", "pair_logits"}`` (no ``pair_logits`` without a pair head)."""
        padding_mask = batch.get("padding_mask")
        if self.c.cp is not None:  # attention reads the whole sequence's key mask
            padding_mask = gather_key_mask(padding_mask, self.c.cp)
        if self.first:
            x = self.embed(batch["tokens"], batch.get("token_types"))
        else:
            x = inputs["hidden"]
        x = self.encode(x, padding_mask)
        if not self.last:
            return {"hidden": x}
        word = self.embed.word.weight if self.embed is not None else None
        out = {"mlm_logits": self.mlm(x, word)}
        if self.pair is not None:
            out["pair_logits"] = self.pair(self.pooled(x))
        return out

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """``{"mlm": (sum, count)}`` of the token cross-entropy over the labels that are
        not ``IGNORE_INDEX``, and ``{"pair": (sum, batch size)}`` with a pair head."""
        logits, labels = outputs["mlm_logits"], batch["labels"]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp)
        terms = {"mlm": (losses.sum(), (labels != IGNORE_INDEX).sum())}
        if "pair_logits" in outputs:
            pair_labels = batch["pair_labels"]
            pair = self.c.kernels.cross_entropy(outputs["pair_logits"], pair_labels)
            terms["pair"] = (pair.sum(), _count(pair_labels))
        return terms

    def metrics(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """``mlm_accuracy`` over the masked tokens (argmax over the vocab shards) and
        ``pair_accuracy`` over the sequences: ``(correct, count)`` each."""
        labels = batch["labels"]
        predicted = vocab_parallel_argmax(outputs["mlm_logits"].detach(), self.tp)
        valid = labels != IGNORE_INDEX
        found = {"mlm_accuracy": (((predicted == labels) & valid).sum(), valid.sum())}
        if "pair_logits" in outputs:
            pair_labels = batch["pair_labels"]
            correct = (outputs["pair_logits"].detach().argmax(-1) == pair_labels).sum()
            found["pair_accuracy"] = (correct, _count(pair_labels))
        return found

    def tied_copies(self) -> list[nn.Parameter]:
        """This chunk's half of the word embedding / decoder pair split over pipeline
        stages (none when one chunk holds both)."""
        if self.first and self.last:
            return []
        if self.first:
            return [self.embed.word.weight]
        return [self.mlm.decoder.weight] if self.last else []

    def own_parameter_names(self) -> list[str]:
        """Names of the parameters that belong in a checkpoint (no decoder copy)."""
        return [n for n, _ in self.named_parameters() if n != DECODER_COPY]


def _count(labels: Tensor) -> Tensor:
    return torch.tensor(labels.numel(), device=labels.device)


def build(
    config: BertConfig, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None
) -> BuiltModel:
    """This rank's chunks (chunk ``c`` of pipeline rank ``r`` is virtual stage
    ``c * pp + r``, with the layers ``stage_plans`` gives it) and their RNG tracker."""
    return build_chunks(Bert, config, layout, backend, seed, fp8)
