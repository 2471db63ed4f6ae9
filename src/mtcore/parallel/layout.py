"""The parallel layout: sizes, this rank's coordinates and its process groups.

An explicit object, passed to the code that needs it (no module globals).

Rank order is "tp-cp-dp-pp", tensor parallel fastest (Megatron's default):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so tensor-parallel peers are neighbours (same node) and pipeline stages are
farthest apart. Expert parallel subdivides the dp x cp ranks of one pipeline
stage: ``ep`` consecutive ranks of that (dp x cp) block form an expert group,
and the ranks holding the same experts form the expert-data-parallel group.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from mtcore.parallel.settings import Settings


class Axis(str, enum.Enum):
    """The process groups of a layout, one name each (a member equals its string)."""

    TP = "tp"  # tensor parallel
    CP = "cp"  # context parallel
    DP = "dp"  # data parallel
    PP = "pp"  # pipeline parallel
    DP_CP = "dp_cp"  # the data replicas: dp x cp ranks hold the same weights
    EP = "ep"  # expert parallel: consecutive ranks of one dp_cp block
    EDP = "edp"  # expert data parallel: the ranks that hold the same experts
    MP = "mp"  # model parallel: tp x pp, one model replica
    EMBED = "embed"  # the first and last pipeline stage (a tied embedding's two halves)

    def __str__(self) -> str:
        return self.value


AXES = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)  # the rank order's axes, tp fastest
# Groups whose calls block the step: tensor parallelism's, the gradient reduction and
# ZeRO param all-gather of data parallelism (expert params: edp), and expert
# parallelism's token all-to-alls. On one host they get a shared-memory channel where
# the backend offers one (``new_group(latency_bound=True)``): on gloo a 13 MB ZeRO-1
# reduce-scatter and all-gather took 30 + 14 ms, through the channel 6 + 4 ms
# (docs/results/megatron.md, dp2-distopt). Each channel costs its group's creation a
# few gloo calls; mp and embed (one call each at a pipeline step's end) showed no gain.
CHANNEL_AXES = (Axis.TP, Axis.DP_CP, Axis.EDP, Axis.EP)
# Groups whose sends and receives are on the critical path: the pipeline's stages (1F1B
# waits on every boundary transfer). On one host they go through a shared-memory mailbox
# (``new_group(p2p=True)``).
P2P_AXES = (Axis.PP,)


class LayoutError(ValueError):
    """A layout that cannot work; raised before any process group is created."""


class LayoutSpec(Settings):
    """Sizes of each parallel dimension. ``dp=None`` takes what the world leaves."""

    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    dp: int | None = Field(None, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1, description="virtual pipeline stages per rank (interleaved 1F1B)")
    sequence_parallel: bool = False
    cp_method: Literal["ring", "allgather", "a2a"] = Field(
        "ring",
        description="context-parallel attention: K/V ring, K/V all-gather, or all-to-all "
        "head sharding (Ulysses)",
    )

    first_stage_layers: int | None = Field(
        None,
        ge=0,
        description="layers on the first pipeline rank (Megatron's "
        "--decoder-first-pipeline-num-layers); None: an even share",
    )
    last_stage_layers: int | None = Field(
        None,
        ge=0,
        description="layers on the last pipeline rank (Megatron's "
        "--decoder-last-pipeline-num-layers); None: an even share",
    )

    @model_validator(mode="after")
    def _sp_needs_tp(self) -> LayoutSpec:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it shards activations over tp)")
        if self.pp == 1 and self.uneven:
            raise ValueError("first_stage_layers / last_stage_layers need pp > 1")
        return self

    @property
    def uneven(self) -> bool:
        """The first or last pipeline rank holds its own number of layers."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def resolve(self, world_size: int) -> LayoutSpec:
        """A copy with ``dp`` filled in and every product checked against ``world_size``."""
        other = self.tp * self.cp * self.pp
        dp = self.dp
        if dp is None:
            if world_size % other:
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp*cp*pp = "
                    f"{self.tp}*{self.cp}*{self.pp} = {other}"
                )
            dp = world_size // other
        if other * dp != world_size:
            raise LayoutError(
                f"tp*cp*dp*pp = {self.tp}*{self.cp}*{dp}*{self.pp} = {other * dp} "
                f"but the world has {world_size} ranks"
            )
        if (dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp*cp = {dp}*{self.cp} = {dp * self.cp}")
        return self.model_copy(update={"dp": dp})

    def check_model(
        self,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        num_layers: int | None = None,
        num_experts: int | None = None,
        vocab_size: int | None = None,
        seq_len: int | None = None,
    ) -> None:
        """Reject a model that this layout cannot split, naming the numbers."""
        checks = [
            (num_heads, self.tp, "attention heads", "tp"),
            (num_kv_heads, self.tp, "key/value heads", "tp"),
            (num_experts, self.ep, "experts", "ep"),
            (vocab_size, self.tp, "vocabulary entries", "tp"),
        ]
        for count, size, what, axis in checks:
            if count is not None and count % size:
                raise LayoutError(f"{count} {what} are not divisible by {axis}={size}")
        seq_checks = []
        if self.cp > 1:  # the load-balanced split: 2*cp chunks, two per cp rank
            seq_checks.append((2 * self.cp, "2*cp", f"2*{self.cp}"))
        if self.sequence_parallel:
            seq_checks.append((self.tp * self.cp, "tp*cp", f"{self.tp}*{self.cp}"))
        for size, axis, numbers in seq_checks:
            if seq_len is not None and seq_len % size:
                raise LayoutError(
                    f"sequence length {seq_len} is not divisible by {axis} = {numbers} = {size}"
                )
        if self.cp > 1 and self.cp_method == "a2a":  # Ulysses shards each tp rank's heads
            for count, what in ((num_heads, "attention heads"), (num_kv_heads, "key/value heads")):
                if count is not None and (count // self.tp) % self.cp:
                    raise LayoutError(
                        f"cp_method a2a splits each tp rank's {count // self.tp} {what} "
                        f"({count} / tp={self.tp}) over cp={self.cp}, which does not divide "
                        "them; use cp_method ring or allgather, or another cp"
                    )


@dataclass(frozen=True)
class GroupView:
    """One group of this rank: the process group (None in a single process), its
    members and this rank's index among them."""

    axis: Axis
    group: object
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelLayout:
    """A resolved layout for one rank, with its groups.

    In a multi-rank world every group exists, size-1 groups included: a
    collective on ``group=None`` would mean the whole world, never "just me".
    Groups are None only in a single process (``single()``).

    Build with ``ParallelLayout.build(spec, collective, rank, world_size)`` inside
    an initialised process group, or ``ParallelLayout.single()`` for one process.
    """

    spec: LayoutSpec
    rank: int
    world_size: int
    groups: dict[Axis, object] = field(default_factory=dict)
    ranks_of: dict[Axis, tuple[int, ...]] = field(default_factory=dict)

    # -- construction --------------------------------------------------------------
    @classmethod
    def single(cls, spec: LayoutSpec | None = None) -> ParallelLayout:
        spec = (spec or LayoutSpec()).resolve(1)
        return cls(spec, 0, 1, {}, {axis: (0,) for axis in Axis if axis is not Axis.EMBED})

    @classmethod
    def build(cls, spec: LayoutSpec, collective, rank: int, world_size: int) -> ParallelLayout:
        """Create every group. All ranks must call this with the same spec."""
        spec = spec.resolve(world_size)
        layout = cls(spec, rank, world_size)
        for axis, members in _all_groups(spec):
            group = (
                collective.new_group(
                    members, latency_bound=axis in CHANNEL_AXES, p2p=axis in P2P_AXES
                )
                if world_size > 1
                else None
            )
            if rank in members:
                layout.groups[axis] = group
                layout.ranks_of[axis] = tuple(members)
        return layout

    # -- sizes and coordinates -----------------------------------------------------
    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def cp(self) -> int:
        return self.spec.cp

    @property
    def dp(self) -> int:
        return self.spec.dp

    @property
    def pp(self) -> int:
        return self.spec.pp

    @property
    def ep(self) -> int:
        return self.spec.ep

    def coordinate(self, axis: Axis) -> int:
        """This rank's index along ``axis``."""
        return self.ranks_of[Axis(axis)].index(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coordinate(Axis.TP)

    @property
    def dp_rank(self) -> int:
        return self.coordinate(Axis.DP)

    @property
    def pp_rank(self) -> int:
        return self.coordinate(Axis.PP)

    def along(self, axis: Axis) -> GroupView:
        """This rank's group of kind ``axis``: process group, members, index."""
        return GroupView(
            Axis(axis), self.group(axis), self.ranks_of[Axis(axis)], self.coordinate(axis)
        )

    @property
    def dp_cp(self) -> GroupView:
        """The data replicas (dp x cp): gradients, loss counts and FP8 histories are
        reduced over them."""
        return self.along(Axis.DP_CP)

    @property
    def edp(self) -> GroupView:
        """The ranks that hold the same experts (expert gradients are reduced over them)."""
        return self.along(Axis.EDP)

    @property
    def mp(self) -> GroupView:
        """One model replica: the tp x pp ranks (a gradient norm is summed over them)."""
        return self.along(Axis.MP)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, axis: Axis):
        """The process group of kind ``axis`` (``Axis.EMBED`` only on the first and last
        pipeline stage, only when pp > 1)."""
        axis = Axis(axis)
        if axis not in self.ranks_of:
            # Returning None here would let a caller reduce over the whole world by mistake.
            raise KeyError(f"rank {self.rank} belongs to no {axis.value!r} group in this layout")
        return self.groups.get(axis)

    def size(self, axis: Axis) -> int:
        return len(self.ranks_of[Axis(axis)])


def _rank(spec: LayoutSpec, tp: int, cp: int, dp: int, pp: int) -> int:
    return tp + spec.tp * (cp + spec.cp * (dp + spec.dp * pp))


def _all_groups(spec: LayoutSpec):
    """Every group of every kind, in one fixed order (all ranks create all groups)."""
    t, c, d, p = spec.tp, spec.cp, spec.dp, spec.pp
    sizes = {Axis.TP: t, Axis.CP: c, Axis.DP: d, Axis.PP: p}
    for axis in AXES:
        others = [a for a in AXES if a != axis]
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            coords = {a.value: i for a, i in zip(others, fixed, strict=True)}
            yield axis, [_rank(spec, **{**coords, axis.value: i}) for i in range(sizes[axis])]
    for tp_i, pp_i in itertools.product(range(t), range(p)):
        block = [_rank(spec, tp_i, cp_i, dp_i, pp_i) for dp_i in range(d) for cp_i in range(c)]
        yield Axis.DP_CP, block
        for start in range(0, len(block), spec.ep):
            yield Axis.EP, block[start : start + spec.ep]
        for offset in range(spec.ep):
            yield Axis.EDP, block[offset :: spec.ep]
    for cp_i, dp_i in itertools.product(range(c), range(d)):
        members = [_rank(spec, tp_i, cp_i, dp_i, pp_i) for pp_i in range(p) for tp_i in range(t)]
        yield Axis.MP, members
    if p > 1:  # first and last stage of each pipeline: the two copies of a tied embedding
        for cp_i, dp_i, tp_i in itertools.product(range(c), range(d), range(t)):
            ends = [_rank(spec, tp_i, cp_i, dp_i, 0), _rank(spec, tp_i, cp_i, dp_i, p - 1)]
            yield Axis.EMBED, ends
