"""Global-norm clipping in one process: the same norm and clipped grads as torch."""

from __future__ import annotations

import math

import pytest
import torch

from mtcore.parallel.clip import (
    clip_by_total_norm_,
    clip_grad_norm_,
    counts_for_norm,
    global_norm,
    is_tensor_parallel,
)
from mtcore.parallel.layout import ParallelLayout


def _params(seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize(("max_norm", "norm_type"), [(0.5, 2.0), (100.0, 2.0), (0.5, math.inf)])
def test_matches_torch_clip_grad_norm(max_norm, norm_type):
    ours, ref = _params(), _params()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    got = clip_grad_norm_(
        ours, max_norm, ParallelLayout.single(), None, grad_attr="grad", norm_type=norm_type
    )
    assert got == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_main_grad_is_the_default_and_missing_grads_are_skipped():
    params = _params()
    for p in params:
        p.main_grad, p.grad = p.grad, None
    params.append(torch.nn.Parameter(torch.ones(3)))  # no gradient at all
    norm = clip_grad_norm_(params, 1e9, ParallelLayout.single(), None)
    want = torch.linalg.vector_norm(torch.cat([p.main_grad.flatten() for p in params[:3]]))
    assert norm == pytest.approx(want.item(), rel=1e-6)


def test_tensor_parallel_duplicates_count_once():
    sharded, replicated = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    sharded.tp_partition = object()  # what the tp layers set
    assert is_tensor_parallel(sharded) and not is_tensor_parallel(replicated)
    assert counts_for_norm(sharded, 0) and counts_for_norm(sharded, 1)
    assert counts_for_norm(replicated, 0) and not counts_for_norm(replicated, 1)


def test_global_norm_edge_cases():
    assert global_norm([], None, [None]).item() == 0.0
    with pytest.raises(ValueError):
        global_norm([torch.ones(2)], None, [], norm_type=1.0)
    g = [torch.full((4,), 3.0, dtype=torch.bfloat16)]
    assert global_norm(g, None, []).dtype == torch.float32
    assert global_norm(g, None, []).item() == 6.0


def test_no_scaling_below_max_norm():
    g = [torch.tensor([3.0, 4.0])]
    clip_by_total_norm_(g, 10.0, torch.tensor(5.0))
    assert g[0].tolist() == [3.0, 4.0]
    clip_by_total_norm_(g, 1.0, torch.tensor(5.0))
    torch.testing.assert_close(g[0], torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))
