"""The ring's sliding-window blocks in one process: every (rank, source block) pair of
the load-balanced split, merged as the ring merges them, equals one process's windowed
attention at that rank's positions, forward and backward (float64, reference kernels)."""

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.ops import attention, merge_attention
from mtcore.parallel.context import chunk_ids, local_positions
from mtcore.parallel.context.window import windowed_chunks_lse

SEQ = 24


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [1, 3, 4, 7, 9, 30])
def test_ring_blocks_with_a_window_equal_one_process(cp, window):
    kernels = select_backend("cpu").kernels
    g = torch.Generator().manual_seed(window)
    q, k, v = (
        torch.randn(1, h, SEQ, 4, generator=g, dtype=torch.float64).requires_grad_()
        for h in (2, 1, 1)
    )
    mask = torch.ones(1, SEQ, dtype=torch.bool)
    mask[0, 5] = False
    want = attention(q, k, v, causal=True, key_padding_mask=mask, window=window)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        mine = local_positions(SEQ, cp, rank)
        out = lse = None
        for src in range(cp):
            theirs = local_positions(SEQ, cp, src)
            part = windowed_chunks_lse(
                q[:, :, mine], k[:, :, theirs], v[:, :, theirs], mask[:, theirs],
                chunk_ids(cp, rank), chunk_ids(cp, src), window, kernels,
            )  # fmt: skip
            out, lse = part if out is None else merge_attention(out, lse, *part)
        torch.testing.assert_close(out, want[:, :, mine], rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(out, (q, k, v), dout[:, :, mine])
        got_grads = [a + b for a, b in zip(got_grads, grads, strict=True)]
    for got, ref in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
