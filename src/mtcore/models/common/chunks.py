"""What a family's model shares as pipeline chunks: building one, building a rank's, and
the hidden states that cross between them.

A family's model class (``GPT``, ``Bert``) serves the whole model and each pipeline
chunk of it: the blocks ``layers`` (keyed by their global index) and, on the first
chunk, the embedding, on the last, the head. How a chunk starts (its context, its
blocks), which chunks a rank builds and what one stage sends the next are the same
for every stack of blocks over hidden states, so the families take them from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mtcore.models.common.layers import Context, make_context, single_context
from mtcore.models.family import BuiltModel, MessageSpecs
from mtcore.parallel.pipeline import TensorSpec, stage_plans
from mtcore.precision.fp8 import FP8Recipe


class PipelineChunk(nn.Module):
    """The start every family's model class shares: ``config``, the context ``c`` (one
    process's when none is given), ``tp``, ``first`` / ``last``, the embedding on the
    first chunk and the blocks of ``layers`` (None: all of them).

    ``embedding(c)`` and ``block(c, index)`` make the family's modules; they are
    registered embedding first, then the blocks in ``layers`` order, before anything a
    subclass adds, so parameter names and order are the family's own.
    """

    def __init__(
        self,
        config,
        context: Context | None,
        layers: range | None,
        first: bool,
        last: bool,
        embedding: Callable[[Context], nn.Module],
        block: Callable[[Context, int], nn.Module],
    ):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
        c = context or single_context(config)
        self.config, self.c, self.tp = config, c, c.tp
        self.first, self.last = first, last
        layers = range(config.num_layers) if layers is None else layers
        self.embed = embedding(c) if first else None
        self.layers = nn.ModuleDict({str(i): block(c, i) for i in layers})


def build_chunks(
    chunk_class: type[PipelineChunk],
    config,
    layout,
    backend,
    seed: int = 0,
    fp8: FP8Recipe | None = None,
) -> BuiltModel:
    """This rank's chunks of ``chunk_class`` and the RNG tracker they share.

    Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` and owns the
    layers ``mtcore.parallel.pipeline.stage_plans`` gives it (the layout's first and last
    stage layer counts included); the config refuses a layout it cannot be split by first.
    """
    config.check_layout(layout.spec)
    c = make_context(config, layout, backend, seed, fp8)
    spec = layout.spec
    plans = stage_plans(
        config.num_layers,
        layout.pp,
        layout.pp_rank,
        spec.vpp,
        first=spec.first_stage_layers,
        last=spec.last_stage_layers,
    )
    chunks = [chunk_class(config, c, p.layers, p.has_embedding, p.has_head) for p in plans]
    return BuiltModel(chunks, c.tracker)


def hidden_state_messages(
    config, layout, micro_batch_size: int, dtype: torch.dtype
) -> MessageSpecs:
    """One tensor crosses every boundary: ``"hidden"``, the hidden states
    ``[micro_batch_size, seq_len / cp, hidden_size]``, a sequence shard over tp too
    under sp (anything else a stage needs, e.g. a padding mask, it reads from the
    batch)."""
    sp = layout.spec.sequence_parallel and layout.tp > 1
    seq = config.seq_len // layout.cp
    seq = seq // layout.tp if sp else seq
    spec = {"hidden": TensorSpec((micro_batch_size, seq, config.hidden_size), dtype)}
    return lambda boundary: spec
