"""The pieces of 1-bit Adam's compression, in one process (a one-rank group)."""

from __future__ import annotations

import pytest
import torch

from mtcore.parallel.optimizer.onebit import (
    OneBitReducer,
    block_scales,
    decode,
    pack_signs,
    unpack_signs,
)


class _OneRank:
    """A collective whose exchanges are copies: a group of one rank (or, for a larger
    size, every peer sending what this rank sends)."""

    def all_to_all(self, output, input, group=None):
        output.copy_(input)

    def all_gather(self, output, input, group=None):
        output.copy_(input.repeat(output.numel() // input.numel()))


def test_pack_and_unpack_round_trip_and_take_an_eighth():
    signs = torch.rand(8 * 37, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_signs(signs)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert torch.equal(unpack_signs(packed), signs)
    assert pack_signs(torch.tensor([True] + [False] * 7)).item() == 1  # element 0 is bit 0
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(9, dtype=torch.bool))


def test_scale_is_the_mean_magnitude_of_each_blocks_real_elements():
    x = torch.tensor([1.0, -3.0, 2.0, 0.0, 4.0, -4.0, 0.0, 0.0])
    real = torch.tensor([4.0, 2.0])  # the second block's last two elements are padding
    assert block_scales(x, real, 4).tolist() == [1.5, 4.0]
    want = [1.5, -1.5, 1.5, 1.5, 4.0, -4.0, 4.0, 4.0]
    assert decode(x >= 0, torch.tensor([1.5, 4.0]), 4).tolist() == want


def test_error_feedback_keeps_what_compression_lost():
    """Over steps, the sum of the compressed outputs tracks the sum of the inputs: the
    difference is exactly the errors still owed (worker's and server's)."""
    g = torch.Generator().manual_seed(1)
    reducer = OneBitReducer(21, _OneRank(), None, size=1, rank=0, device="cpu")
    assert reducer.chunk == 24 and reducer.real == [21]
    sent, received = torch.zeros(21, dtype=torch.float64), torch.zeros(21, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(21, generator=g)
        sent += x.double()
        out = reducer.average_(x.clone())
        assert out.abs().unique().numel() == 1  # one block: one scale
        received += out.double()
        owed = reducer.worker_error[:21].double() + reducer.server_error[:21].double()
        assert torch.allclose(sent - received, owed, atol=1e-5)
        assert not reducer.worker_error[21:].any() and not reducer.server_error[21:].any()
    # Without feedback (a fresh reducer each step) the errors pile up instead.
    g = torch.Generator().manual_seed(1)
    forgetful = torch.zeros(21, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(21, generator=g)
        fresh = OneBitReducer(21, _OneRank(), None, size=1, rank=0, device="cpu")
        forgetful += x.double() - fresh.average_(x.clone()).double()
    assert (sent - received).norm() < 0.5 * forgetful.norm()


def test_layout_of_chunks_and_blocks():
    small = OneBitReducer(9, _OneRank(), None, size=1, rank=0, device="cpu")
    assert (small.chunk, small.block) == (16, 16)  # a small tensor: one block per chunk
    four = OneBitReducer(9, _OneRank(), None, size=4, rank=0, device="cpu")
    assert (four.chunk, four.real) == (8, [8, 1, 0, 0])
    big = OneBitReducer(10_000, _OneRank(), None, size=2, rank=0, device="cpu", block=2048)
    assert (big.block, big.chunk, big.real) == (2048, 6144, [6144, 3856])
    assert big.message_bytes == 6144 // 8 + 4 * 3
    with pytest.raises(ValueError, match="multiple of 8"):
        OneBitReducer(100, _OneRank(), None, size=1, rank=0, device="cpu", block=12)


class _Recording(_OneRank):
    def all_to_all(self, output, input, group=None):
        self.sent = input.clone()
        super().all_to_all(output, input, group)


def test_chunks_of_padding_only_send_scale_zero():
    """Ranks 2 and 3 serve chunks past the end of a 9-element tensor: scale 0, so they
    contribute zeros, not +-scale of whatever sign the padding has."""
    collective = _Recording()
    reducer = OneBitReducer(9, collective, None, size=4, rank=0, device="cpu")
    reducer.average_(torch.arange(1.0, 10.0))
    scales = collective.sent[:, 1:].contiguous().view(torch.float32).reshape(-1)
    assert scales[0] == 4.5 and scales[1] == 9.0  # chunk 1 holds one real element (9)
    assert scales[2:].tolist() == [0.0, 0.0]
    assert reducer.worker_error[9:].abs().sum() == 0
