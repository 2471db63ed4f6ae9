"""GPT: a decoder-only transformer (Radford et al. 2019; Llama, Touvron et al. 2023).

One class serves the whole model and each pipeline chunk of it: a ``GPT`` holds
the layers ``layers`` (keyed by their global index) and, on the first chunk, the
embedding, on the last, the final norm and the output layer. Parameter names are
the whole model's at any layout (``layers.7.mlp.fc1.weight``), so checkpoints
and comparisons need no renaming::

    model = GPT(config)                     # one process: model(tokens, targets) -> loss
    chunks = build_gpt(config, layout, backend, seed, vpp)   # this rank's chunks

Every weight is drawn on the host from a generator seeded by (seed, module name),
whole, then sliced for tp: any layout starts from the same numbers as one process.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor, nn

from mtcore.data.documents import DOCUMENTS, POSITIONS
from mtcore.models.common.chunks import PipelineChunk, build_chunks
from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.common.decoder.mtp import PredictionModule, mtp_targets, mtp_term, shifted
from mtcore.models.common.decoder.rope import gpt_rope_tables
from mtcore.models.common.latent_attention import LatentAttention
from mtcore.models.common.layers import MLP, Attention, Context, Norm, out_std
from mtcore.models.common.sampling import continue_tokens
from mtcore.models.family import BuiltModel
from mtcore.parallel.context import DocumentIds
from mtcore.parallel.moe import MoELayer
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    column_parallel_matmul,
    gather_from_tp,
    mark_sequence_parallel,
    normal_init,
    vocab_parallel_cross_entropy,
)
from mtcore.precision.fp8 import FP8Recipe

IGNORE_INDEX = -100


class Embedding(nn.Module):
    """Token embedding (vocab split over tp), plus learned positions for GPT-2."""

    def __init__(self, c: Context):
        super().__init__()
        cfg, g = c.config, c.generator("embed")
        self.c = c
        self.tok = VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            c.tp,
            sequence_parallel=c.sequence_parallel,
            init_method=normal_init(cfg.init_std),
            generator=g,
            device=c.device,
        )
        self.pos = None
        if cfg.position == "learned":
            pos = torch.empty(cfg.seq_len, cfg.hidden_size)
            normal_init(cfg.init_std)(pos, c.generator("embed.pos"))
            self.pos = nn.Parameter(pos.to(c.device))
            if c.sequence_parallel:  # each rank adds only its positions
                mark_sequence_parallel(self, "pos")

    def forward(self, tokens: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """``offset``: the position of the first token (a decoding step after a cache);
        ``positions``: each token's own ``[b, s]`` (restarting per document) instead."""
        x = self.tok(tokens)  # [b, s, h], or [b, s / tp, h] under sequence parallel
        if self.pos is not None:
            s, start = x.shape[1], offset
            if self.c.sequence_parallel:
                start = self.c.tp.rank * s
            if positions is not None:  # this rank's tokens' (its sequence shard under sp)
                rows = positions[:, start - offset : start - offset + s]
            else:
                rows = self.c.positions(start, s)  # global positions under cp
            x = x + self.pos[rows].to(x.dtype)
        return self.c.dropout(x, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    In a MoE layer (``config.is_moe_layer(index)``) ``mlp`` is a ``MoELayer``.
    """

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        g = c.generator(f"layers.{index}")
        self.attn_norm, self.attn = Norm(c), _attention(c, g)
        self.mlp_norm = Norm(c)
        self.mlp = _moe(c, g) if c.config.is_moe_layer(index) else MLP(c, g)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, cache: dict | None = None,
        documents: DocumentIds | None = None,
    ) -> Tensor:  # fmt: skip
        attended = self.attn(self.attn_norm(x), rope, cache=cache, documents=documents)
        x = x + self.c.dropout(attended, self.training)
        return x + self.c.dropout(self.mlp(self.mlp_norm(x)), self.training)


def _attention(c: Context, generator: torch.Generator) -> Attention | LatentAttention:
    """The block's attention: multi-head latent attention with ``mla`` (DeepSeek);
    with ``qkv_bias`` (Qwen2) its q, k and v have biases.

    ``Attention`` gives all its linears the config's ``bias``. Biases start at zero and
    draw nothing from the generator, so the attention is built as a biased one and its
    output projection's bias removed: the weights are those of the unbiased model.
    """
    cfg = c.config
    if getattr(cfg, "mla", None) is not None:
        return LatentAttention(c, generator)
    if not getattr(cfg, "qkv_bias", False) or cfg.bias:
        return Attention(c, generator)
    biased = dataclasses.replace(c, config=cfg.model_copy(update={"bias": True}))
    attn = Attention(biased, generator)
    attn.c = c
    attn.proj.bias = None
    return attn


def _moe(c: Context, generator: torch.Generator) -> MoELayer:
    """The MoE layer of a block; its experts are split over the layout's ep group."""
    cfg = c.config
    return MoELayer(
        cfg.hidden_size,
        cfg.moe,
        tp=c.tp,
        layout=c.layout,
        backend=c.backend,
        sequence_parallel=c.sequence_parallel,
        generator=generator,
        init_std=cfg.init_std,
        out_std=out_std(cfg),
        bias=cfg.bias,
        device=c.device,
    )


class GPT(PipelineChunk):
    """The whole model (default) or one pipeline chunk: ``layers`` with or without
    the embedding (``first``) and the output layer (``last``)."""

    def __init__(
        self,
        config: DecoderConfig,
        context: Context | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__(config, context, layers, first, last, Embedding, Block)
        c = self.c
        self.norm = Norm(c) if last else None
        # The output layer shares the token embedding's weight when tied. On a
        # pipeline stage without the embedding it is a copy drawn from the same
        # generator (equal at init); the trainer keeps the two copies equal by
        # summing their gradients (``tied_copies``).
        self.output = None
        self.output_is_copy = last and not first and config.tie_embeddings
        if last and not (config.tie_embeddings and first):
            self.output = ColumnParallelLinear(
                config.hidden_size,
                config.vocab_size,
                c.tp,
                bias=False,
                sequence_parallel=c.sequence_parallel,
                init_method=normal_init(config.init_std),
                generator=c.generator("embed" if config.tie_embeddings else "output"),
                device=c.device,
            )
            # The gradient norm counts a tied weight once, on the embedding's stage.
            self.output.weight.pipeline_copy = self.output_is_copy
        # Multi-token prediction on the last stage. Without the embedding there (pp > 1)
        # it reads a copy of it, kept equal by summing the two gradients (tied_copies).
        self.mtp = self.mtp_embed = None
        spec = getattr(config, "mtp", None)
        if last and spec is not None:
            blocks = (Block(c, config.num_layers + k) for k in range(spec.depth))
            self.mtp = nn.ModuleList(PredictionModule(c, k + 1, b) for k, b in enumerate(blocks))
            if not first:
                self.mtp_embed = Embedding(c)
                self.mtp_embed.tok.weight.pipeline_copy = True
        self.rope = self.rope_tables = None
        if config.position == "rope":  # plain tensors, not buffers: .to(bf16) must not round them
            self.rope = self.rope_tables = gpt_rope_tables(config, device=c.device)
            if c.cp is not None:  # the rows of this rank's tokens (their global positions)
                rows = c.positions(0, config.seq_len // c.cp.size)
                self.rope = tuple(table[rows] for table in self.rope)

    def forward(
        self, x: Tensor, targets: Tensor | None = None, documents: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """tokens ``[b, s]`` (first chunk) or hidden states -> hidden states, logits
        ``[b, s, vocab / tp]`` (last chunk), or the mean loss when ``targets`` is given.
        ``documents``, ``positions``: a packed sample's (``mtcore.data.documents``)."""
        x = self.body(x, documents, positions)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        total, count = self._cross_entropy(logits, targets)
        return total / count.clamp(min=1)

    def rope_at(self, positions: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The rope tables of this rank's tokens: shared ``[s, d/2]`` rows at their global
        positions, or per-sample ``[b, s, d/2]`` rows at ``positions [b, s]`` (positions
        restarting per document)."""
        if self.rope is None or positions is None:
            return self.rope
        return self.rope_tables[0][positions], self.rope_tables[1][positions]

    def body(
        self, x: Tensor, documents: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Tokens (first chunk) or hidden states through this chunk's blocks; with the
        batch's ``documents`` each token attends only its own document."""
        rope, ids = self.rope_at(positions), self.document_ids(documents)
        if self.embed is not None:
            x = self.embed(x, positions=positions)
        for block in self.layers.values():
            if self.config.recompute == "full":
                x = checkpoint(
                    block, x, rope, None, ids, backend=self.c.backend, tracker=self.c.tracker
                )
            else:
                x = block(x, rope, documents=ids)
        return x

    def document_ids(self, documents: Tensor | None) -> DocumentIds | None:
        """The batch's document ids as attention reads them (gathered once over cp)."""
        return DocumentIds.of(documents, self.c.cp) if documents is not None else None

    def head(self, x: Tensor) -> Tensor:
        """Normed hidden states -> logits ``[b, s, vocab / tp]`` (the output layer, or the
        tied embedding)."""
        if self.output is not None:
            return self.output(x)
        return column_parallel_matmul(
            x, self.embed.tok.weight, None, self.tp, self.c.sequence_parallel
        )

    @torch.no_grad()
    def cached_logits(
        self, new: Tensor, caches: list[dict], offset: int, embedded: Tensor | None = None
    ) -> Tensor:
        """Logits ``[b, s, vocab]`` (whole vocabulary, on every tp rank) of the tokens
        ``new [b, s]`` at positions ``offset ..``; the tokens before them are in
        ``caches`` (one dict per layer, grown here: ``Attention``'s ``cache``).
        ``embedded``: their embeddings when the family makes its own (LLaVA's images)."""
        x = self.embed(new, offset) if embedded is None else embedded
        rope = None
        if self.rope is not None:
            end = offset + new.shape[1]
            rope = (self.rope[0][offset:end], self.rope[1][offset:end])
        for block, cache in zip(self.layers.values(), caches, strict=True):
            x = block(x, rope, cache)
        return gather_from_tp(self.head(self.norm(x)), self.tp)

    # -- the pipeline-stage contract (mtcore.models.family) --------------------------
    def stage(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``{"hidden"}`` from the previous stage (or ``batch["tokens"]`` on the first)
        -> ``{"hidden"}`` for the next, or ``{"logits"}`` on the last (and each
        multi-token-prediction module's ``{"mtp_k"}`` logits)."""
        documents, positions = batch.get(DOCUMENTS), batch.get(POSITIONS)
        x = self.body(batch["tokens"] if self.first else inputs["hidden"], documents, positions)
        if not self.last:
            return {"hidden": x}
        out = {"logits": self.head(self.norm(x))}
        embed = self.embed if self.embed is not None else self.mtp_embed
        rope, ids = self.rope_at(positions), self.document_ids(documents)
        for k, module in enumerate(self.mtp or (), start=1):
            x = module(x, embed(shifted(batch["tokens"], k, 0), positions=positions), rope, ids)
            out[mtp_term(k)] = self.head(module.norm(x))
        return out

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """Next-token cross-entropy: ``{"lm": (sum, count)}`` over the labels that are
        not ``IGNORE_INDEX``; with multi-token prediction, ``{"mtp_k": ...}`` of module
        k's targets (``labels[i + k]``), its sum weighted ``loss_weight / depth``."""
        terms = {"lm": self._cross_entropy(outputs["logits"], batch["labels"])}
        for k in range(1, len(self.mtp or ()) + 1):
            total, count = self._cross_entropy(
                outputs[mtp_term(k)], mtp_targets(batch["labels"], k)
            )
            weight = self.config.mtp.loss_weight / self.config.mtp.depth
            terms[mtp_term(k)] = (weight * total, count)
        return terms

    def _cross_entropy(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.tp)
        return losses.sum(), (labels != IGNORE_INDEX).sum()

    def metrics(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        return {}

    def tied_copies(self) -> list[nn.Parameter]:
        """This chunk's halves of a tied embedding/output pair split over pipeline stages
        (or of the embedding and its copy for multi-token prediction on the last stage)."""
        copied = self.config.tie_embeddings or getattr(self.config, "mtp", None) is not None
        if not copied or (self.first and self.last):
            return []
        if self.first:
            return [self.embed.tok.weight]
        if not self.last:
            return []
        return [self.output.weight] if self.config.tie_embeddings else [self.mtp_embed.tok.weight]

    def own_parameter_names(self) -> list[str]:
        """Names of the parameters that belong in a checkpoint (no tied copy)."""
        copies = {"output.weight"} if self.output_is_copy else set()
        if self.mtp_embed is not None:
            copies.add("mtp_embed.tok.weight")
        return [n for n, _ in self.named_parameters() if n not in copies]

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        top_k: int | None = None,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Append ``max_new_tokens`` to ``tokens [b, s]``: greedy when ``top_k`` is None
        or 1, else sampling among the ``top_k`` likeliest (every tp rank must pass a
        ``generator`` in the same state, so that the ranks pick the same tokens).

        The whole model (pp=1, cp=1, no sequence parallel); tp may be > 1, each rank
        computing its heads and the logits gathered. With ``use_cache`` each layer keeps
        its keys and values, so a step reads one token, while the sequence fits
        ``seq_len``; then (and with ``use_cache=False``) each step reads the last
        ``seq_len`` tokens whole.
        """
        if not (self.first and self.last) or self.c.sequence_parallel or self.c.cp is not None:
            raise ValueError(
                "generate() runs on the whole model: pp=1, cp=1 and no sequence parallel"
            )
        cached = None
        if use_cache:
            caches = [{} for _ in self.layers]
            cached = functools.partial(self.cached_logits, caches=caches)
        return continue_tokens(
            lambda t: gather_from_tp(self(t), self.tp), tokens, max_new_tokens,
            self.config.seq_len, top_k, temperature, generator, cached,
        )  # fmt: skip


def build_gpt(
    config: DecoderConfig, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None
) -> list[GPT]:
    """This rank's model chunks, chunk 0 first (one chunk unless ``layout.spec.vpp > 1``).

    Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` and owns the
    layers ``mtcore.parallel.pipeline.stage_plans`` gives it.
    """
    return build(config, layout, backend, seed, fp8).chunks


def build(
    config: DecoderConfig, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None
) -> BuiltModel:
    """``build_gpt``'s chunks with the RNG tracker they share (the family's ``build``)."""
    return build_chunks(GPT, config, layout, backend, seed, fp8)
