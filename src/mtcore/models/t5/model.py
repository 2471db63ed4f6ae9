"""T5: an encoder-decoder transformer trained on span corruption (Raffel et al. 2020,
arXiv 1910.10683; the v1.1 architecture; Megatron-Core's T5Model is the peer).

One class serves the whole model and each pipeline chunk of it. The encoder and the
decoder layers form one stack, ``layers.0`` .. ``layers.{E-1}`` the encoder's and
``layers.{E}`` .. the decoder's, split over the pipeline's virtual stages
(``T5Config.stage_counts``): a stage may end inside the encoder, at its end, inside
the decoder, or hold the end of one and the start of the other.

Two hidden-state messages cross every boundary, ``"encoder"`` and ``"decoder"``: in
the encoder's part of the pipeline they are the encoder's running hidden states and
the embedded decoder input (stage 0 embeds both, so the shared embedding lives on one
stage and no copy of it is needed for the decoder input); after the encoder's last
layer ``"encoder"`` is its final output, which every decoder stage attends to, and
its gradient flows back to the encoder stages with the decoder's. Each stack's
relative position bias is computed once per micro-batch on the stage holding its
first layer and travels as ``"encoder_bias"`` / ``"decoder_bias"`` to the stages
holding the stack's other layers (its gradient flows back to the table).

Parameter names are the whole model's at any layout. Under sequence parallelism
both hidden-state messages are sequence shards; the cross-attention's key/value
projection gathers the encoder output.

Under context parallelism (``parallel.cp_method: allgather``) each cp rank holds two
of ``2 * cp`` chunks of the encoder input and two of the decoder input (the
load-balanced split, each stack by its own length). Every attention gathers its keys
and values over cp (the cross-attention's from the sharded encoder output) in cp
order; each stack's bias is computed for this rank's query positions against the
keys' global positions, and the decoder's causal mask compares global positions too.
"""

from __future__ import annotations

from torch import Tensor, nn

from mtcore.models.common.chunks import PipelineChunk
from mtcore.models.common.layers import Context, Norm, make_context
from mtcore.models.family import BuiltModel, MessageSpecs
from mtcore.models.t5.blocks import (
    DecoderBlock,
    EncoderBlock,
    RelativePositionBias,
    cp_positions,
)
from mtcore.models.t5.config import T5Config
from mtcore.models.t5.names import LM_HEAD
from mtcore.parallel.context import gather_key_mask
from mtcore.parallel.pipeline import TensorSpec
from mtcore.parallel.pipeline.split import stage_plans
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    column_parallel_matmul,
    normal_init,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from mtcore.precision.fp8 import FP8Recipe

IGNORE_INDEX = -100


def _embedding(c: Context) -> nn.Module:
    cfg = c.config
    return VocabParallelEmbedding(
        cfg.vocab_size,
        cfg.hidden_size,
        c.tp,
        sequence_parallel=c.sequence_parallel,
        init_method=normal_init(cfg.init_factor),
        generator=c.generator("embed"),
        device=c.device,
    )


def _block(c: Context, index: int) -> nn.Module:
    return EncoderBlock(c, index) if index < c.config.encoder_layers else DecoderBlock(c, index)


class T5(PipelineChunk):
    """The whole model (default) or one pipeline chunk: ``layers`` of the stack, with
    the shared embedding (``first``) and the LM head (``last``); the encoder's and the
    decoder's bias tables and final norms go with the layers that use them."""

    def __init__(
        self,
        config: T5Config,
        context: Context | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__(config, context, layers, first, last, _embedding, _block)
        c, e = self.c, config.encoder_layers
        held = [int(i) for i in self.layers]
        self.layer_end = held[-1] + 1  # the stack's layers before the next boundary
        self.encoder_bias = RelativePositionBias(c, "encoder_bias", True) if 0 in held else None
        self.encoder_norm = Norm(c) if e - 1 in held else None
        self.decoder_bias = RelativePositionBias(c, "decoder_bias", False) if e in held else None
        self.decoder_norm = Norm(c) if last else None
        # Untied (v1.1): the head's own weight. Tied (original T5): the embedding's, or
        # on a last stage without it a copy drawn from its generator (equal at init);
        # the engine keeps the two equal by summing their gradients (``tied_copies``).
        self.lm_head = None
        self.head_is_copy = last and not first and config.tie_embeddings
        # A copy is drawn as the embedding (std 1); an untied head with std h^-0.5 (not
        # HF's 1.0) starts near the uniform prediction, as the tied head's rescale does.
        head_std = 1.0 if config.tie_embeddings else config.hidden_size**-0.5
        if last and not (first and config.tie_embeddings):
            self.lm_head = ColumnParallelLinear(
                config.hidden_size,
                config.vocab_size,
                c.tp,
                bias=False,
                sequence_parallel=c.sequence_parallel,
                init_method=normal_init(config.init_factor * head_std),
                generator=c.generator("embed" if config.tie_embeddings else "lm_head"),
                device=c.device,
            )
            self.lm_head.weight.pipeline_copy = self.head_is_copy

    def forward(
        self,
        tokens: Tensor,
        decoder_tokens: Tensor,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The whole model: logits ``[b, decoder_len, V/tp]``."""
        if not (self.first and self.last):
            raise ValueError("forward() runs the whole model; a pipeline chunk runs stage()")
        batch = {"tokens": tokens, "decoder_tokens": decoder_tokens, "padding_mask": padding_mask}
        return self.stage({}, batch)["logits"]

    def _run(self, block: nn.Module, *args) -> Tensor:
        if self.config.recompute == "full":
            return checkpoint(block, *args, backend=self.c.backend, tracker=self.c.tracker)
        return block(*args)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.c.dropout(self.embed(tokens), self.training)

    def encode_final(self, x: Tensor) -> Tensor:
        return self.c.dropout(self.encoder_norm(x), self.training)

    def logits(self, x: Tensor) -> Tensor:
        """The decoder's last hidden states -> ``[b, s, V/tp]`` (the sequence gathered
        under sp); tied: scaled by ``hidden_size ** -0.5`` first, as the original T5."""
        x = self.c.dropout(self.decoder_norm(x), self.training)
        if self.config.tie_embeddings:
            x = x * self.config.hidden_size**-0.5
        weight = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        return column_parallel_matmul(x, weight, None, self.tp, self.c.sequence_parallel)

    def bias(self, table: RelativePositionBias, length: int) -> Tensor:
        """A stack's self-attention bias over a sequence of ``length``: ``[1, heads / tp,
        length, length]``; under cp this rank's query rows against the keys in cp order
        (global positions, so each distance is the one-process distance)."""
        if self.c.cp is None:
            return table(length, length)
        return table.between(*cp_positions(length, self.c.cp, table.weight.device))

    # -- the pipeline-stage contract (mtcore.models.family) --------------------------
    def stage(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch["tokens"]`` and ``batch["decoder_tokens"]`` on the first stage, the
        messages (``messages`` below) on the others -> the next boundary's messages, or
        ``{"logits"}`` on the last stage."""
        e, mask = self.config.encoder_layers, batch.get("padding_mask")
        # The batch's lengths (the config's in training; forward() may take others).
        se, sd = batch["tokens"].shape[1], batch["decoder_tokens"].shape[1]
        if self.c.cp is not None:  # this rank's share of each; attention reads every key
            se, sd = se * self.c.cp.size, sd * self.c.cp.size
            mask = gather_key_mask(mask, self.c.cp)
        if self.first:
            enc, dec = (
                self.embed_tokens(batch["tokens"]),
                self.embed_tokens(batch["decoder_tokens"]),
            )
        else:
            enc, dec = inputs["encoder"], inputs["decoder"]
        enc_bias, dec_bias = inputs.get("encoder_bias"), inputs.get("decoder_bias")
        for key, block in self.layers.items():
            i = int(key)
            if i < e:
                if i == 0:
                    enc_bias = self.bias(self.encoder_bias, se)
                enc = self._run(block, enc, enc_bias, mask)
                if i == e - 1:
                    enc = self.encode_final(enc)
            else:
                if i == e:
                    dec_bias = self.bias(self.decoder_bias, sd)
                dec = self._run(block, dec, enc, dec_bias, mask)
        if self.last:
            return {"logits": self.logits(dec)}
        out = {"encoder": enc, "decoder": dec}
        if self.layer_end < e:
            out["encoder_bias"] = enc_bias
        elif self.layer_end > e:
            out["decoder_bias"] = dec_bias
        return out

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """``{"lm": (sum, count)}``: the target's cross-entropy over the labels that are
        not ``IGNORE_INDEX`` (vocab-parallel: the logits are never gathered)."""
        logits, labels = outputs["logits"], batch["labels"]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp)
        return {"lm": (losses.sum(), (labels != IGNORE_INDEX).sum())}

    def metrics(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """``accuracy``: the target tokens predicted exactly (argmax over the shards)."""
        labels = batch["labels"]
        predicted = vocab_parallel_argmax(outputs["logits"].detach(), self.tp)
        valid = labels != IGNORE_INDEX
        return {"accuracy": (((predicted == labels) & valid).sum(), valid.sum())}

    def tied_copies(self) -> list[nn.Parameter]:
        """This chunk's half of a tied embedding / LM head pair split over stages."""
        if not self.config.tie_embeddings or (self.first and self.last):
            return []
        if self.first:
            return [self.embed.weight]
        return [self.lm_head.weight] if self.last else []

    def own_parameter_names(self) -> list[str]:
        """Names of the parameters that belong in a checkpoint (no tied head copy)."""
        names = [n for n, _ in self.named_parameters()]
        return [n for n in names if not (self.head_is_copy and n == LM_HEAD)]


def build(
    config: T5Config, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None
) -> BuiltModel:
    """This rank's chunks (chunk ``c`` of pipeline rank ``r`` is virtual stage
    ``c * pp + r``, with the layers ``T5Config.stage_counts`` gives it) and their RNG
    tracker; the config refuses a layout it cannot be split by first."""
    config.check_layout(layout.spec)
    c = make_context(config, layout, backend, seed, fp8)
    counts = config.stage_counts(layout.pp, layout.spec.vpp)
    plans = stage_plans(config.num_layers, layout.pp, layout.pp_rank, layout.spec.vpp, counts)
    chunks = [T5(config, c, p.layers, p.has_embedding, p.has_head) for p in plans]
    return BuiltModel(chunks, c.tracker)


def messages(config: T5Config, layout, micro_batch_size: int, dtype) -> MessageSpecs:
    """What boundary ``k`` carries: ``"encoder"`` ``[b, seq_len, h]`` and ``"decoder"``
    ``[b, decoder_seq_len, h]`` (sequence shards over tp under sp, this rank's share
    under cp), and the bias of the stack whose layers continue past it:
    ``"encoder_bias"`` or ``"decoder_bias"`` ``[1, heads / tp, s / cp, s]``."""
    sp = layout.spec.sequence_parallel and layout.tp > 1
    cp = layout.cp
    shard = cp * (layout.tp if sp else 1)
    h, heads = config.hidden_size, config.num_heads // layout.tp
    se, sd = config.seq_len, config.decoder_seq_len
    hidden = {
        "encoder": TensorSpec((micro_batch_size, se // shard, h), dtype),
        "decoder": TensorSpec((micro_batch_size, sd // shard, h), dtype),
    }
    counts = config.stage_counts(layout.pp, layout.spec.vpp)
    e = config.encoder_layers

    def at(boundary: int) -> dict[str, TensorSpec]:
        end = sum(counts[: boundary + 1])
        if end < e:
            return {**hidden, "encoder_bias": TensorSpec((1, heads, se // cp, se), dtype)}
        if end > e:
            return {**hidden, "decoder_bias": TensorSpec((1, heads, sd // cp, sd), dtype)}
        return hidden

    return at
