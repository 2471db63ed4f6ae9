"""What the planner needs to know of a model: its transformer blocks, embedding and head.

Each family writes its own (``ModelFamily.shape``: a ``ModelShape`` of ``Block`` s,
``mtcore.models.shape``); the planner reads only that, never a family's config fields.
A family without one is "not modelled": ``model_shape`` raises ``NotModelled`` naming
it, rather than guessing.

Parameters that do not train (a frozen part of a vision-language model) are held as
weights only: the trainer gives them no gradient buffer, master weight, optimizer
state or data-parallel reduction (``requires_grad`` is off). ``stage_params`` says
how many of each one tensor-parallel rank of a pipeline stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtcore.models import family_of
from mtcore.models.shape import Block, ModelShape, NotModelled

__all__ = ["Block", "ModelShape", "NotModelled", "StageParams", "model_shape", "stage_params"]


def model_shape(config) -> ModelShape:
    """The planner's view of a ``FamilyConfig``: its family's ``shape``, or
    ``NotModelled`` naming a family that provides none."""
    return family_of(config).shape(config)


@dataclass(frozen=True)
class StageParams:
    """Parameters one tp rank of a pipeline stage holds. ``trained``: dense weights with
    gradients, master weights and optimizer state, reduced over dp x cp; ``experts``:
    trained routed experts (over tp x ep, reduced over their edp group); ``frozen``:
    weights only."""

    trained: float
    experts: float
    frozen: float


def stage_params(shape: ModelShape, blocks, tp: int, ep: int, pp: int, first: bool, last: bool):
    """``StageParams`` of a pipeline rank whose chunks hold ``blocks`` (``((block, how
    many), ...)``, as the planner groups them): blocks sharded over tp (experts over
    tp x ep; latent attention's down-projections whole on every rank), the embedding on the first stage and the head on the last sharded over tp
    (a tied embedding on both when pp > 1), ``first_stage_params`` whole."""
    trained = sum(n * b.tp_rank_weights(tp) for b, n in blocks if not b.frozen)
    frozen = sum(n * b.tp_rank_weights(tp) for b, n in blocks if b.frozen)
    experts = sum(n * b.expert_weights() for b, n in blocks if not b.frozen) / (tp * ep)
    frozen_experts = sum(n * b.expert_weights() for b, n in blocks if b.frozen) / (tp * ep)
    ends = 0.0
    if first:
        ends += shape.embed_params
    if last:
        ends += shape.head_params
        if pp > 1 and (shape.tied or shape.last_blocks):  # a copy of the embedding
            ends += shape.embed_params
    frozen += frozen_experts
    if shape.embed_frozen:
        frozen += ends / tp
    else:
        trained += ends / tp
    if last:
        trained += shape.last_stage_params
    if first:
        trained += shape.first_stage_params - shape.first_stage_frozen
        frozen += shape.first_stage_frozen
    return StageParams(trained=trained, experts=experts, frozen=frozen)
