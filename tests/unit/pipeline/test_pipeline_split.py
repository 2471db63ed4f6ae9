"""Layer split over (rank, chunk), batch validation, and the pipeline groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.parallel.pipeline import (
    PipelineGroups,
    SplitError,
    StageModule,
    layer_counts,
    num_microbatches,
    stage_plan,
    stage_plans,
    validate_pipeline,
)


def test_even_split_is_chunk_major():
    # pp=2, vpp=2, 8 layers: virtual stages 0..3 = (r0 c0), (r1 c0), (r0 c1), (r1 c1)
    got = {(p.rank, p.chunk): list(p.layers) for r in range(2) for p in stage_plans(8, 2, r, 2)}
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    first, last = stage_plan(8, 2, 0, 2, 0), stage_plan(8, 2, 1, 2, 1)
    assert first.has_embedding and not first.has_head and first.virtual_stage == 0
    assert last.has_head and not last.has_embedding and last.virtual_stage == 3
    assert not any(
        p.has_head or p.has_embedding
        for p in (stage_plan(8, 2, 1, 2, 0), stage_plan(8, 2, 0, 2, 1))
    )
    assert [list(p.layers) for p in stage_plans(6, 3, 1)] == [[2, 3]]


def test_uneven_split_only_when_given():
    with pytest.raises(SplitError, match=r"10 layers are not divisible by pp\*vpp = 2\*2 = 4"):
        layer_counts(10, 2, 2)
    assert layer_counts(10, 2, 2, [3, 2, 2, 3]) == [3, 2, 2, 3]
    assert list(stage_plan(10, 2, 1, 2, 1, counts=[3, 2, 2, 3]).layers) == [7, 8, 9]
    with pytest.raises(SplitError, match=r"sum to 9, but the model has 10"):
        layer_counts(10, 2, 2, [3, 2, 2, 2])
    with pytest.raises(SplitError, match=r"gives 3 layer counts, but pp\*vpp = 2\*2 = 4"):
        layer_counts(10, 2, 2, [4, 3, 3])
    with pytest.raises(SplitError, match="outside"):
        stage_plan(8, 2, 2)


def test_first_and_last_stage_layers():
    """Megatron's first/last pipeline layer counts, by hand: the ranks between share the
    rest; over chunks, the model's end holds the fewer (Llama 3 405B's 126 layers)."""
    assert layer_counts(126, 16, first=7, last=7) == [7] + [8] * 14 + [7]
    assert layer_counts(70, 12, first=5, last=5) == [5] + [6] * 10 + [5]
    assert layer_counts(10, 3, first=2) == [2, 4, 4]
    assert layer_counts(5, 2, last=1) == [4, 1]
    llama = layer_counts(126, 16, 8, first=7, last=7)  # vpp 8: one layer per chunk
    assert llama[0] == 0 and llama[-1] == 0 and set(llama[1:-1]) == {1} and sum(llama) == 126
    # 6 layers, pp2 x vpp2, 1 and 5: virtual stages (r0 c0, r1 c0, r0 c1, r1 c1)
    assert layer_counts(6, 2, 2, first=1, last=5) == [0, 3, 1, 2]
    got = [[list(p.layers) for p in stage_plans(6, 2, r, 2, first=1, last=5)] for r in range(2)]
    assert got == [[[], [3]], [[0, 1, 2], [4, 5]]]
    assert stage_plan(6, 2, 0, 2, 0, first=1, last=5).has_embedding
    assert layer_counts(6, 3, 2, first=1, last=1) == [0, 2, 1, 1, 2, 0]
    with pytest.raises(SplitError, match=r"the 3 layers between .* over 1 pipeline ranks x vpp=2"):
        layer_counts(4, 2, 2, first=1)
    with pytest.raises(SplitError, match=r"the 5 layers between .* do not split evenly over 2"):
        layer_counts(11, 4, first=3, last=3)
    with pytest.raises(SplitError, match="leave -2 of the model's 4 layers"):
        layer_counts(4, 2, first=3, last=3)
    with pytest.raises(SplitError, match="need pp > 1"):
        layer_counts(4, 1, first=2)
    assert validate_pipeline(8, 1, 1, pp=4, num_layers=10, first=1, last=1) == 8
    with pytest.raises(ValueError, match="need pp > 1"):
        LayoutSpec(first_stage_layers=2)


def test_batch_validation_names_the_numbers():
    assert num_microbatches(64, 2, 4) == 8
    with pytest.raises(
        SplitError, match=r"global batch 30 is not divisible by micro-batch x dp = 4 x 2 = 8"
    ):
        num_microbatches(30, 4, 2)
    assert validate_pipeline(32, 2, 2, pp=4, num_layers=8, vpp=2) == 8
    with pytest.raises(
        SplitError, match=r"micro-batches \(6 = 24 / \(2 x 2\)\) to be a multiple of pp \(4\)"
    ):
        validate_pipeline(24, 2, 2, pp=4, num_layers=8, vpp=2)
    with pytest.raises(SplitError, match="not divisible by pp"):
        validate_pipeline(32, 2, 2, pp=4, num_layers=6)


def test_stage_module_keeps_whole_model_names():
    layers = {3: nn.Linear(4, 4), 2: nn.Linear(4, 4)}
    stage = StageModule(
        layers, pre=nn.Embedding(5, 4), post=nn.Linear(4, 5), names=("embed", "head")
    )
    names = [n for n, _ in stage.named_parameters()]
    assert names[:2] == ["embed.weight", "head.weight"] and "layers.2.weight" in names
    x = torch.tensor([[1, 2]])
    want = stage.head(layers[3](layers[2](stage.embed(x))))  # layers run in index order
    torch.testing.assert_close(stage(x), want)


class _FakeCollective:
    def __init__(self):
        self.created = []

    def new_group(self, ranks, latency_bound=False, p2p=False):
        self.created.append(tuple(ranks))
        return f"group{tuple(ranks)}"

    def barrier(self, group=None):
        self.created.append("barrier")


def test_groups_follow_the_layout_on_every_rank():
    spec = LayoutSpec(tp=2, pp=2)  # 8 ranks: dp = 2
    created = None
    for rank in range(8):
        coll = _FakeCollective()
        layout = ParallelLayout.build(spec, coll, rank, 8)
        before = len(coll.created)
        groups = PipelineGroups.build(layout, coll)
        mine = coll.created[before:]
        assert created is None or mine == created  # same groups, same order, on every rank
        created = mine
        assert groups.ranks == layout.ranks_of[Axis.PP] and groups.pp_rank == layout.pp_rank
        assert groups.embedding_ranks == (rank % 4, rank % 4 + 4)
        assert groups.embedding_group == f"group{groups.embedding_ranks}"
    # The embedding groups are the layout's; the pipeline itself only adds a barrier.
    assert created == ["barrier"]


def test_single_stage_has_no_embedding_group():
    groups = PipelineGroups.build(ParallelLayout.single(), _FakeCollective())
    assert groups.ranks == (0,) and not groups.in_embedding_group
