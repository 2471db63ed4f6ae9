"""Packed samples, the document split, and the resumable data-parallel sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtcore.data.cache import DataError
from mtcore.data.corpus import find_files
from mtcore.data.indexed import get_indexed_dataset
from mtcore.data.loader import EpochSampler, TokenLoader, check_batch_sizes
from mtcore.data.samples import SequenceDataset, split_documents


@pytest.fixture
def index(trained, tmp_path):
    tok, root = trained
    return get_indexed_dataset(find_files(root), tok, tmp_path / "cache", "corpus")


def test_split_is_by_document_disjoint_covering_and_deterministic():
    train, valid = split_documents(100, 0.1)
    assert len(valid) == 10 and len(train) == 90
    assert not set(train) & set(valid) and set(train) | set(valid) == set(range(100))
    again = split_documents(100, 0.1)
    assert np.array_equal(train, again[0]) and np.array_equal(valid, again[1])
    assert len(split_documents(100, 0.0)[1]) == 0
    assert len(split_documents(3, 0.01)[1]) == 1  # a requested split is never empty
    with pytest.raises(DataError, match="at least 2"):
        split_documents(1, 0.1, "tiny")


def test_samples_pack_the_documents_of_a_split(index):
    train_ids, valid_ids = split_documents(len(index), 0.25)
    ds = SequenceDataset(index, train_ids, seq_len=16)
    stream = np.concatenate([index.document(i) for i in train_ids])
    assert np.array_equal(ds.stream(), stream)
    assert len(ds) == (len(stream) - 1) // 16
    for i in [0, 1, len(ds) // 2, len(ds) - 1]:
        assert np.array_equal(ds[i], stream[i * 16 : i * 16 + 17])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(DataError, match=r"seq_len \+ 1 = 100001"):
        SequenceDataset(index, valid_ids, seq_len=100_000, name="corpus/valid")


def _run(dataset, steps, **kw):
    loader = TokenLoader(dataset, **kw)
    return [next(loader) for _ in range(steps)], loader


@pytest.mark.parametrize("dp_rank, dp_size", [(0, 1), (1, 2)])
def test_resume_never_repeats_or_skips(index, dp_rank, dp_size):
    ds = SequenceDataset(index, np.arange(len(index)), seq_len=32)
    kw = dict(
        micro_batch_size=3, global_batch_size=6 * dp_size, dp_rank=dp_rank, dp_size=dp_size, seed=7
    )
    steps = 2 * len(ds) // (3 * dp_size) + 3  # crosses two epoch boundaries
    full, _ = _run(ds, steps, **kw)
    for k in [1, 5, steps // 2 + 1]:
        head, loader = _run(ds, k, **kw)
        state = loader.state_dict()
        resumed = TokenLoader(ds, **kw)
        resumed.load_state_dict(state)
        tail = [next(resumed) for _ in range(steps - k)]
        for (a, b), (c, d) in zip(full, head + tail, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_batches_are_shifted_int64(index):
    ds = SequenceDataset(index, np.arange(len(index)), seq_len=32)
    [(tokens, targets)], _ = _run(ds, 1, micro_batch_size=4)
    assert tokens.shape == targets.shape == (4, 32) and tokens.dtype == targets.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = EpochSampler(50, seed=3)
    first, second = sampler.take(50), sampler.take(50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert not np.array_equal(first, second)
    straddle = EpochSampler(50, seed=3)
    straddle.take(45)
    assert np.array_equal(straddle.take(10), np.concatenate([first[45:], second[:5]]))
    assert list(EpochSampler(5, shuffle=False).take(7)) == [0, 1, 2, 3, 4, 0, 1]


def test_dp_shards_are_disjoint_strided_slices_of_the_global_batch():
    n, micro, dp, accum = 1000, 2, 3, 4
    gb = micro * dp * accum
    stream = EpochSampler(n, seed=11).take(5 * gb)
    ranks = [TokenLoader(range(n), micro, gb, dp_rank=r, dp_size=dp, seed=11) for r in range(dp)]
    assert ranks[0].grad_accum == accum
    for step in range(5):
        batch = stream[step * gb : (step + 1) * gb]
        got = [np.concatenate([r.next_indices() for _ in range(accum)]) for r in ranks]
        for r in range(dp):
            assert sorted(got[r]) == sorted(batch[r::dp])
        assert sorted(np.concatenate(got)) == sorted(batch)  # disjoint and covering


def test_batch_size_and_state_checks_name_the_numbers():
    assert check_batch_sizes(32, 4, 2) == 4
    with pytest.raises(DataError, match=r"global_batch_size=30 .* 4 \* 2 = 8"):
        check_batch_sizes(30, 4, 2)
    with pytest.raises(DataError, match="dp_rank=2"):
        TokenLoader(range(10), 1, dp_rank=2, dp_size=2)
    saved = TokenLoader(range(10), 1, seed=1).state_dict()
    with pytest.raises(DataError, match="seed=1"):
        TokenLoader(range(10), 1, seed=2).load_state_dict(saved)
    with pytest.raises(DataError, match="num_samples=10"):
        TokenLoader(range(11), 1, seed=1).load_state_dict(saved)


def test_resume_with_another_dp_size_continues_the_global_stream():
    stream = EpochSampler(100, seed=5).take(60)
    before = [TokenLoader(range(100), 4, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    seen = [np.concatenate([rank.next_indices() for _ in range(3)]) for rank in before]
    after = TokenLoader(range(100), 6, dp_rank=0, dp_size=1, seed=5)
    after.load_state_dict(before[0].state_dict())
    seen.append(np.concatenate([after.next_indices() for _ in range(6)]))
    assert sorted(np.concatenate(seen)) == sorted(stream)
