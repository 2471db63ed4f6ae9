"""Tensor-parallel building blocks in one process: sharding maths, init, tp=1 identity.

A ``TPGroup`` with ``size=2`` and no process group is enough to build a rank's
layer: construction never communicates, so the shards each rank would hold can
be checked here against the one-process weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, Context, GPTConfig, build_gpt
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    TPPartition,
    VocabParallelEmbedding,
    copy_to_tp,
    full_tensors,
    gather_from_sp,
    gather_from_tp,
    load_full_tensors,
    named_tp_parameters,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    shard_tensor,
    unshard_tensor,
)

CONFIG = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=16, bias=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def backend():
    return select_backend("cpu")


def fake_rank(backend, rank, size=2):
    return TPGroup(backend, None, size, rank)


def fake_rank_gpt(backend, rank: int, seed: int, sequence_parallel: bool = False) -> GPT:
    """The GPT that tp rank ``rank`` of 2 would build (no process group, no RNG tracker)."""
    c = Context(CONFIG, fake_rank(backend, rank), backend, None, sequence_parallel,
                backend.torch_device(), seed)  # fmt: skip
    return GPT(CONFIG, c)


def test_mappings_are_the_identity_at_tp1(backend):
    tp = TPGroup.single(backend)
    x = torch.randn(2, 4, 6)
    for fn in (
        copy_to_tp,
        reduce_from_tp,
        scatter_to_tp,
        gather_from_tp,
        scatter_to_sp,
        reduce_scatter_to_sp,
    ):
        assert fn(x, tp) is x
    assert gather_from_sp(x, tp) is x


def test_tp_group_from_single_layout(backend):
    tp = TPGroup.from_layout(ParallelLayout.single(), backend)
    assert (tp.size, tp.rank, tp.group) == (1, 0, None)


@pytest.mark.parametrize("dim,sections", [(0, (12,)), (0, (8, 4, 4)), (1, (6,))])
def test_shard_then_unshard_is_the_identity(dim, sections):
    full = torch.arange(16 * 12, dtype=torch.float32).view(16, 12)
    if dim == 1:
        full = full[:, :6]
    elif sum(sections) != 12:
        full = full[: sum(sections)]
    else:
        full = full[:12]
    p = TPPartition(dim, sections)
    shards = [shard_tensor(full, p, r, 2) for r in range(2)]
    assert torch.equal(unshard_tensor(shards, p), full)


def test_sections_are_split_separately():
    full = torch.arange(8.0)  # sections [0..3] and [4..7]
    p = TPPartition(0, (4, 4))
    assert shard_tensor(full, p, 0, 2).tolist() == [0, 1, 4, 5]
    assert shard_tensor(full, p, 1, 2).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(torch.arange(6.0), TPPartition(0, (3, 3)), 0, 2)


def test_layers_at_tp1_match_torch(backend):
    tp = TPGroup.single(backend)
    x = torch.randn(2, 3, 8)
    col = ColumnParallelLinear(8, 6, tp, generator=torch.Generator().manual_seed(0))
    expect = torch.empty(6, 8).normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    assert torch.equal(col.weight, expect)
    assert torch.equal(col(x), F.linear(x, expect, torch.zeros(6)))
    row = RowParallelLinear(8, 6, tp, bias=False, generator=torch.Generator().manual_seed(0))
    assert torch.equal(row(x), F.linear(x, expect))
    emb = VocabParallelEmbedding(10, 4, tp, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[0, 9, 3]])
    assert torch.equal(emb(tokens), emb.weight[tokens])


@pytest.mark.parametrize(
    "make",
    [
        lambda tp, g: ColumnParallelLinear(8, 12, tp, sections=(4, 4, 4), generator=g),
        lambda tp, g: RowParallelLinear(8, 6, tp, generator=g),
        lambda tp, g: VocabParallelEmbedding(10, 4, tp, generator=g),
    ],
    ids=["column_sections", "row", "embedding"],
)
def test_each_rank_holds_its_slice_of_the_one_process_weight(backend, make):
    ref = make(TPGroup.single(backend), torch.Generator().manual_seed(3))
    ranks = [make(fake_rank(backend, r), torch.Generator().manual_seed(3)) for r in range(2)]
    _assert_ranks_unshard_to(ref, ranks)


def _assert_ranks_unshard_to(ref, ranks):
    per_rank = [{n: (p.detach(), part) for n, p, part, _ in named_tp_parameters(m)} for m in ranks]
    for name, p in ref.named_parameters():
        shards = [params[name][0] for params in per_rank]
        part = per_rank[0][name][1]
        full = unshard_tensor(shards, part) if part is not None else shards[0]
        assert torch.equal(full, p.detach()), name


def test_layer_argument_checks(backend):
    with pytest.raises(ValueError, match="do not add up"):
        ColumnParallelLinear(8, 12, TPGroup.single(backend), sections=(4, 4))
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(
            8, 6, fake_rank(backend, 0), input_is_parallel=False, sequence_parallel=True
        )
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(8, 5, fake_rank(backend, 0))


def test_sequence_parallel_flags_only_replicated_params(backend):
    row = RowParallelLinear(8, 6, fake_rank(backend, 1), sequence_parallel=True)
    flags = {name: sp for name, _, _, sp in named_tp_parameters(row)}
    assert flags == {"weight": False, "bias": True}
    assert not RowParallelLinear(
        8, 6, TPGroup.single(backend), sequence_parallel=True
    ).sequence_parallel


def test_full_tensors_and_load_at_tp1(backend):
    (a,) = build_gpt(CONFIG, ParallelLayout.single(), backend, seed=1)
    (b,) = build_gpt(CONFIG, ParallelLayout.single(), backend, seed=2)
    load_full_tensors(b, full_tensors(a, a.tp), b.tp)
    for name, value in full_tensors(b, b.tp).items():
        assert torch.equal(value, dict(a.named_parameters())[name]), name
    assert all(v is None for v in full_tensors(a, a.tp, grads=True).values())
    wrong = {**full_tensors(a, a.tp), "norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="does not fit"):
        load_full_tensors(b, wrong, b.tp)


def test_gpt_shards_like_one_process(backend):
    """A tp=2 rank's GPT holds its slice of every one-process weight."""
    (ref,) = build_gpt(CONFIG, ParallelLayout.single(), backend, seed=5)
    _assert_ranks_unshard_to(ref, [fake_rank_gpt(backend, r, seed=5) for r in range(2)])


def test_shard_metadata_survives_deepcopy(backend):
    """Recorded on modules, not on Parameter objects (which deepcopy recreates bare)."""
    model = fake_rank_gpt(backend, 0, seed=0, sequence_parallel=True)
    twin = copy.deepcopy(model)
    meta = [(n, part, sp) for n, _, part, sp in named_tp_parameters(model)]
    assert meta == [(n, part, sp) for n, _, part, sp in named_tp_parameters(twin)]
    assert any(sp for *_, sp in meta) and any(part is not None for _, part, _ in meta)
    assert twin.tp is model.tp


def test_param_list_consumers_see_the_attributes_too(backend):
    """Clipping and data-parallel buffers only get parameters: they read attributes."""
    row = RowParallelLinear(8, 6, fake_rank(backend, 1), sequence_parallel=True)
    assert row.weight.tp_partition == TPPartition(1, (8,))
    assert row.bias.sequence_parallel and not hasattr(row.bias, "tp_partition")
