"""Which layers each pipeline stage owns, and the batch arithmetic the trainer checks.

Layers are spread over ``pp * vpp`` virtual stages in chunk-major order
(Megatron interleaving): virtual stage ``c * pp + r`` is chunk ``c`` of rank
``r`` and owns the next contiguous range of layers. The embedding lives on
virtual stage 0 (rank 0, chunk 0), the output layer and the loss on the last
one (rank pp-1, chunk vpp-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class SplitError(ValueError):
    """A model or batch that the pipeline layout cannot split, naming the numbers."""


@dataclass(frozen=True)
class StagePlan:
    """What chunk ``chunk`` of pipeline rank ``rank`` holds."""

    rank: int
    chunk: int
    virtual_stage: int
    layers: range
    has_embedding: bool
    has_head: bool


def layer_counts(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    counts: Sequence[int] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> list[int]:
    """Layers per virtual stage (index ``c * pp + r``); even unless ``counts`` says otherwise,
    or ``first`` / ``last`` give the first / last pipeline rank its own number of layers
    (``uneven_counts``)."""
    stages = pp * vpp
    if counts is not None:
        counts = list(counts)
        if len(counts) != stages:
            raise SplitError(
                f"uneven split gives {len(counts)} layer counts, but pp*vpp = {pp}*{vpp} = {stages} "
                "virtual stages need one each (in order chunk * pp + rank)"
            )
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise SplitError(
                f"layer counts {counts} sum to {sum(counts)}, but the model has {num_layers} layers"
            )
        return counts
    if first is not None or last is not None:
        return uneven_counts(num_layers, pp, vpp, first, last)
    if num_layers % stages:
        raise SplitError(
            f"{num_layers} layers are not divisible by pp*vpp = {pp}*{vpp} = {stages}; "
            "pass explicit per-stage layer counts for an uneven split"
        )
    return [num_layers // stages] * stages


def uneven_counts(
    num_layers: int, pp: int, vpp: int, first: int | None, last: int | None
) -> list[int]:
    """Layers per virtual stage when the first pipeline rank holds ``first`` layers and the
    last ``last`` (None: an even share), Megatron's ``--decoder-first-pipeline-num-layers``
    and ``--decoder-last-pipeline-num-layers``: the ranks between share the rest evenly.

    A rank's layers are spread over its ``vpp`` chunks as evenly as they go; where they
    do not divide, the chunk at the model's end holds the fewer (the first rank's chunk 0,
    the last rank's last chunk), as Llama 3 balanced its pipeline: one layer fewer on
    the first and the last stage, the first chunk holding only the embedding.
    """
    if pp < 2:
        raise SplitError(f"first/last stage layer counts need pp > 1 (pp={pp})")
    given = {rank: n for rank, n in ((0, first), (pp - 1, last)) if n is not None}
    for rank, n in given.items():
        if n < 0:
            raise SplitError(f"pipeline rank {rank} cannot hold {n} layers")
    rest, middle = num_layers - sum(given.values()), pp - len(given)
    if rest < 0 or (middle == 0 and rest):
        raise SplitError(
            f"first/last stage layers {first}/{last} leave {rest} of the model's {num_layers} "
            f"layers for {middle} other pipeline ranks"
        )
    if middle and (rest % (middle * vpp) or rest == 0):
        raise SplitError(
            f"the {rest} layers between the first and last stage ({num_layers} - {first or 0} "
            f"- {last or 0}) do not split evenly over {middle} pipeline ranks x vpp={vpp} "
            f"= {middle * vpp} chunks"
        )
    share = rest // (middle * vpp) if middle else 0
    counts = [share] * (pp * vpp)
    for rank, n in given.items():
        low, extra = divmod(n, vpp)
        chunks = [low] * vpp
        # the extras go away from the model's end: the first rank's last chunks, the last's first
        for i in range(extra):
            chunks[vpp - 1 - i if rank == 0 else i] += 1
        for chunk, count in enumerate(chunks):
            counts[chunk * pp + rank] = count
    return counts


def encoder_decoder_counts(
    encoder_layers: int, decoder_layers: int, pp: int, vpp: int = 1, split_rank: int | None = None
) -> list[int]:
    """Layers per virtual stage of an encoder-decoder stack (encoder layers first, then
    the decoder's, as one sequence of ``encoder_layers + decoder_layers`` layers).

    ``split_rank`` None: the whole stack split evenly, so the encoder/decoder boundary
    falls wherever the sizes put it: inside a stage's run (the stage ends the encoder
    and starts the decoder), at a stage boundary, or deeper. ``split_rank = k``
    (Megatron's pipeline split rank, over virtual stages): stages ``0..k-1`` share the
    encoder evenly and stages ``k..`` the decoder. A stage left empty, or a stack that
    does not divide, is a SplitError naming the numbers.
    """
    stages = pp * vpp
    if encoder_layers < 1 or decoder_layers < 1:
        raise SplitError(
            f"an encoder-decoder needs layers in both stacks, got {encoder_layers} encoder "
            f"and {decoder_layers} decoder layers"
        )
    total = encoder_layers + decoder_layers
    if split_rank is None:
        if total < stages:
            raise SplitError(
                f"{encoder_layers} encoder + {decoder_layers} decoder = {total} layers leave "
                f"pipeline stages empty: pp*vpp = {pp}*{vpp} = {stages} stages need one each"
            )
        return layer_counts(total, pp, vpp)
    if not 0 < split_rank < stages:
        raise SplitError(
            f"pipeline split rank {split_rank} must leave encoder and decoder stages: it must "
            f"be in [1, pp*vpp - 1] = [1, {stages - 1}]"
        )
    counts = []
    for layers, parts, what in (
        (encoder_layers, split_rank, "encoder"),
        (decoder_layers, stages - split_rank, "decoder"),
    ):
        if layers % parts:
            raise SplitError(
                f"pipeline split rank {split_rank} gives the {what} {parts} stage(s), which "
                f"do not divide its {layers} layers"
            )
        counts += [layers // parts] * parts
    return counts


def stage_plan(
    num_layers: int,
    pp: int,
    rank: int,
    vpp: int = 1,
    chunk: int = 0,
    counts: Sequence[int] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> StagePlan:
    """The layers and the extras (embedding, head) of ``(rank, chunk)``."""
    if not (0 <= rank < pp and 0 <= chunk < vpp):
        raise SplitError(f"rank {rank}, chunk {chunk} is outside pp={pp}, vpp={vpp}")
    sizes = layer_counts(num_layers, pp, vpp, counts, first, last)
    stage = chunk * pp + rank
    start = sum(sizes[:stage])
    return StagePlan(
        rank, chunk, stage, range(start, start + sizes[stage]), stage == 0, stage == pp * vpp - 1
    )


def stage_plans(
    num_layers: int,
    pp: int,
    rank: int,
    vpp: int = 1,
    counts: Sequence[int] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> list[StagePlan]:
    """Every chunk of ``rank``, chunk 0 first."""
    return [stage_plan(num_layers, pp, rank, vpp, c, counts, first, last) for c in range(vpp)]


def num_microbatches(global_batch: int, micro_batch: int, dp: int = 1) -> int:
    """Micro-batches per step and data-parallel rank; the trainer calls this before any
    process group exists so that a batch that does not divide fails early."""
    if global_batch < 1 or micro_batch < 1 or dp < 1:
        raise SplitError(
            f"need positive sizes; got global batch {global_batch}, micro-batch {micro_batch}, dp {dp}"
        )
    if global_batch % (micro_batch * dp):
        raise SplitError(
            f"global batch {global_batch} is not divisible by micro-batch x dp = "
            f"{micro_batch} x {dp} = {micro_batch * dp}"
        )
    return global_batch // (micro_batch * dp)


def validate_pipeline(
    global_batch: int,
    micro_batch: int,
    dp: int,
    pp: int,
    num_layers: int,
    vpp: int = 1,
    counts: Sequence[int] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> int:
    """Check batch and layer split together; return the number of micro-batches."""
    m = num_microbatches(global_batch, micro_batch, dp)
    layer_counts(num_layers, pp, vpp, counts, first, last)
    if vpp > 1 and m % pp:
        raise SplitError(
            f"interleaved 1F1B needs the number of micro-batches ({m} = {global_batch} / "
            f"({micro_batch} x {dp})) to be a multiple of pp ({pp})"
        )
    return m
