"""Which layers each pipeline stage owns, and the batch arithmetic the trainer checks.

Layers are spread over ``pp * vpp`` virtual stages in chunk-major order
(Megatron interleaving): virtual stage ``c * pp + r`` is chunk ``c`` of rank
``r`` and owns the next contiguous range of layers. The embedding lives on
virtual stage 0 (rank 0, chunk 0), the output layer and the loss on the last
one (rank pp-1, chunk vpp-1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn


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


def layer_counts(num_layers: int, pp: int, vpp: int = 1, counts: Sequence[int] | None = None) -> list[int]:
    """Layers per virtual stage (index ``c * pp + r``); even unless ``counts`` says otherwise."""
    stages = pp * vpp
    if counts is not None:
        counts = list(counts)
        if len(counts) != stages:
            raise SplitError(
                f"uneven split gives {len(counts)} layer counts, but pp*vpp = {pp}*{vpp} = {stages} "
                "virtual stages need one each (in order chunk * pp + rank)"
            )
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise SplitError(f"layer counts {counts} sum to {sum(counts)}, but the model has {num_layers} layers")
        return counts
    if num_layers % stages:
        raise SplitError(
            f"{num_layers} layers are not divisible by pp*vpp = {pp}*{vpp} = {stages}; "
            "pass explicit per-stage layer counts for an uneven split"
        )
    return [num_layers // stages] * stages


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
    num_layers: int, pp: int, rank: int, vpp: int = 1, chunk: int = 0, counts: Sequence[int] | None = None
) -> StagePlan:
    """The layers and the extras (embedding, head) of ``(rank, chunk)``."""
    if not (0 <= rank < pp and 0 <= chunk < vpp):
        raise SplitError(f"rank {rank}, chunk {chunk} is outside pp={pp}, vpp={vpp}")
    sizes = layer_counts(num_layers, pp, vpp, counts)
    stage = chunk * pp + rank
    start = sum(sizes[:stage])
    return StagePlan(
        rank, chunk, stage, range(start, start + sizes[stage]), stage == 0, stage == pp * vpp - 1
    )


def stage_plans(num_layers: int, pp: int, rank: int, vpp: int = 1, counts: Sequence[int] | None = None) -> list[StagePlan]:
    """Every chunk of ``rank``, chunk 0 first."""
    return [stage_plan(num_layers, pp, rank, vpp, c, counts) for c in range(vpp)]


def num_microbatches(global_batch: int, micro_batch: int, dp: int = 1) -> int:
    """Micro-batches per step and data-parallel rank; the trainer calls this before any
    process group exists so that a batch that does not divide fails early."""
    if global_batch < 1 or micro_batch < 1 or dp < 1:
        raise SplitError(f"need positive sizes; got global batch {global_batch}, micro-batch {micro_batch}, dp {dp}")
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
) -> int:
    """Check batch and layer split together; return the number of micro-batches."""
    m = num_microbatches(global_batch, micro_batch, dp)
    layer_counts(num_layers, pp, vpp, counts)
    if vpp > 1 and m % pp:
        raise SplitError(
            f"interleaved 1F1B needs the number of micro-batches ({m} = {global_batch} / "
            f"({micro_batch} x {dp})) to be a multiple of pp ({pp})"
        )
    return m


class StageModule(nn.Module):
    """One chunk: optional ``pre`` (embedding), a run of layers, optional ``post`` (head).

    ``layers`` maps each global layer index to its module, and ``pre`` /
    ``post`` are registered under ``names``, so parameter names
    (``layers.7.weight``, ``embed.weight``) match the whole model's.
    ``call_layer(layer, x)`` runs one layer (default ``layer(x)``), for layers
    that take extra arguments.
    """

    def __init__(
        self,
        layers: dict[int, nn.Module],
        pre: nn.Module | None = None,
        post: nn.Module | None = None,
        call_layer: Callable[[nn.Module, Tensor], Tensor] | None = None,
        names: tuple[str, str] = ("pre", "post"),
    ):
        super().__init__()
        self._names = names
        for name, module in zip(names, (pre, post), strict=True):
            if module is not None:
                self.add_module(name, module)
        self.layers = nn.ModuleDict({str(i): m for i, m in sorted(layers.items())})
        self._call = call_layer or (lambda layer, x: layer(x))

    def forward(self, x: Tensor) -> Tensor:
        pre, post = (getattr(self, n, None) for n in self._names)
        if pre is not None:
            x = pre(x)
        for layer in self.layers.values():
            x = self._call(layer, x)
        if post is not None:
            x = post(x)
        return x
