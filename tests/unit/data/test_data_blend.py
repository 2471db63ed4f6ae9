"""Blending by weight: deterministic, and every dataset's share tracks its weight."""

from __future__ import annotations

import numpy as np
import pytest

from mtcore.data.blend import BlendedDataset, blending_indices
from mtcore.data.cache import DataError


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1], [7, 0.01, 2.5, 1], [1]])
def test_realised_fractions_track_the_weights(weights):
    size = 10_000
    which, k = blending_indices(weights, size)
    w = np.asarray(weights) / np.sum(weights)
    counts = np.bincount(which, minlength=len(w))
    assert np.all(np.abs(counts / size - w) < 0.01)
    # stronger: on every prefix each dataset is within two samples of its target
    seen = np.cumsum(np.eye(len(w), dtype=np.int64)[which], axis=0)
    target = np.arange(1, size + 1)[:, None] * w[None, :]
    assert np.abs(seen - target).max() <= 2
    # sample indices count up within each dataset: no sample of a dataset is skipped
    for d in range(len(w)):
        assert np.array_equal(k[which == d], np.arange(counts[d]))
    again = blending_indices(weights, size)
    assert np.array_equal(which, again[0]) and np.array_equal(k, again[1])


class _Fake:
    def __init__(self, tag, n, seq_len=4):
        self.name, self.n, self.seq_len = tag, n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return np.array([self.name, i])


def test_blended_dataset_wraps_small_datasets():
    blend = BlendedDataset([_Fake(0, 10), _Fake(1, 1000)], [0.5, 0.5], size=400)
    items = np.stack([blend[i] for i in range(len(blend))])
    assert np.sum(items[:, 0] == 0) == 200 and set(items[items[:, 0] == 0, 1]) == set(range(10))
    assert len(BlendedDataset([_Fake(0, 10), _Fake(1, 30)], [1, 1])) == 40


def test_bad_blends_are_rejected():
    with pytest.raises(DataError, match="positive"):
        blending_indices([1, 0], 10)
    with pytest.raises(DataError, match="2 datasets but 1 weights"):
        BlendedDataset([_Fake(0, 3), _Fake(1, 3)], [1])
    with pytest.raises(DataError, match="seq_len"):
        BlendedDataset([_Fake(0, 3, seq_len=4), _Fake(1, 3, seq_len=8)], [1, 1])
