"""The column-parallel backward gives the same gradients blocking and overlapped
(``MTCORE_TP_OVERLAP=0`` / ``1``), with and without sequence parallel, on 2 gloo ranks;
and the switch's default and its bad values."""

from __future__ import annotations

import os

import pytest
import torch

from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.tensor import TPGroup, column_parallel_matmul
from mtcore.parallel.tensor.linear import OVERLAP_ENV, overlaps_backward_collectives
from mtcore.testing.distributed import run_ranks


def _grads(ctx) -> dict[str, list[torch.Tensor]]:
    out = {}
    for sp in (False, True):
        layout = ParallelLayout.build(
            LayoutSpec(tp=2, sequence_parallel=sp), ctx.backend.collective, ctx.rank, 2
        )
        tp = TPGroup.from_layout(layout, ctx.backend)
        g = torch.Generator().manual_seed(3)
        x_full = torch.randn(2, 8, 12, generator=g)
        w = torch.randn(10, 12, generator=g).chunk(2)[ctx.rank].contiguous()
        b = torch.randn(10, generator=g).chunk(2)[ctx.rank].contiguous()
        probe = torch.randn(2, 8, 5, generator=g)
        x = x_full.chunk(2, dim=1)[ctx.rank].contiguous() if sp else x_full
        for overlap in ("0", "1"):
            os.environ[OVERLAP_ENV] = overlap
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            (column_parallel_matmul(*leaves, tp, sp) * probe).sum().backward()
            out[f"sp={sp} overlap={overlap}"] = [t.grad for t in leaves]
    os.environ.pop(OVERLAP_ENV)
    return out


def test_blocking_and_overlapped_backward_give_the_same_gradients():
    for grads in run_ranks(_grads, 2):
        for sp in (False, True):
            blocking, overlapped = grads[f"sp={sp} overlap=0"], grads[f"sp={sp} overlap=1"]
            for a, b in zip(blocking, overlapped, strict=True):
                assert torch.equal(a, b)


def test_overlap_is_the_default_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlaps_backward_collectives() is True
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert overlaps_backward_collectives() is False
    monkeypatch.setenv(OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match="MTCORE_TP_OVERLAP must be 0 or 1"):
        overlaps_backward_collectives()
