"""Context parallelism in one process: the token split, batch sharding and the checks
that refuse a job before launch (the multi-rank equivalence is
tests/distributed/test_context_parallel.py)."""

from __future__ import annotations

import re
import types

import pytest
import torch

from mtcore.backend.collective import Collective, CollectiveCapabilities, Support
from mtcore.parallel.context import (
    check_backend_serves,
    cp_order,
    cp_to_global,
    local_positions,
    shard_batch,
)
from mtcore.parallel.layout import LayoutError, LayoutSpec
from mtcore.training.overrides import load_config

GPT = ["--model.hidden_size", "32", "--model.num_heads", "4", "--model.num_kv_heads", "2"]


def test_each_rank_holds_its_two_chunks_and_cp_order_inverts():
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    order = cp_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    assert torch.equal(order[cp_to_global(16, 4)], torch.arange(16))
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2\\*cp = 8"):
        local_positions(12, 4, 0)


def test_shard_batch_keeps_this_ranks_tokens_and_whole_per_sequence_tensors():
    tokens = torch.arange(32).view(2, 16)
    batch = {"tokens": tokens, "padding_mask": tokens < 20, "pair_labels": torch.tensor([0, 1])}
    shard = shard_batch(batch, 16, 2, 1)
    assert torch.equal(shard["tokens"], tokens[:, 4:12])
    assert torch.equal(shard["padding_mask"], (tokens < 20)[:, 4:12])
    assert shard["pair_labels"] is batch["pair_labels"]
    assert shard_batch(batch, 16, 1, 0) is batch
    # Every token lands on exactly one rank.
    parts = torch.cat([shard_batch(batch, 16, 4, r)["tokens"] for r in range(4)], dim=1)
    assert sorted(parts[0].tolist()) == list(range(16))
    with pytest.raises(ValueError, match="'short' of shape \\[2, 7\\] has no sequence dimension"):
        shard_batch({**batch, "short": tokens[:, :7]}, 16, 2, 0)


def test_shard_batch_splits_each_tensor_at_its_own_length():
    """T5's encoder and decoder tensors differ in length; LLaVA's pixels stay whole."""
    enc, dec = torch.arange(32).view(2, 16), torch.arange(16).view(2, 8)
    pixels = torch.randn(2, 3, 4, 4)
    lengths = {"tokens": 16, "labels": 8, "pixel_values": None}
    shard = shard_batch({"tokens": enc, "labels": dec, "pixel_values": pixels}, lengths, 2, 1)
    assert torch.equal(shard["tokens"], enc[:, 4:12])
    assert torch.equal(shard["labels"], dec[:, 2:6])
    assert shard["pixel_values"] is pixels
    with pytest.raises(ValueError, match="'extra' has no sequence length to split over cp=2"):
        shard_batch({"tokens": enc, "extra": enc}, lengths, 2, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--parallel.cp", "3", "--model.seq_len", "100"], "sequence length 100 is not divisible by 2\\*cp = 2\\*3 = 6"),
        (
            ["--parallel.cp", "2", "--parallel.tp", "4", "--parallel.sequence_parallel", "true",
             "--model.num_kv_heads", "4", "--model.seq_len", "36"],
            "sequence length 36 is not divisible by tp\\*cp = 4\\*2 = 8",
        ),
        (
            ["--parallel.cp", "4", "--parallel.cp_method", "a2a", "--model.seq_len", "64"],
            "a2a splits each tp rank's 2 key/value heads \\(2 / tp=1\\) over cp=4",
        ),
        (
            ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.cp_method", "a2a",
             "--model.num_kv_heads", "2", "--model.seq_len", "64"],
            "a2a splits each tp rank's 1 key/value heads \\(2 / tp=2\\) over cp=2",
        ),
    ],
)  # fmt: skip
def test_bad_context_parallel_layouts_are_refused_with_the_numbers(overrides, message):
    config = load_config(None, [*GPT, "--model.vocab_size", "64", *overrides])
    world = config.parallel.tp * config.parallel.cp
    with pytest.raises(LayoutError, match=message):
        config.check(world)


def test_context_parallel_layouts_that_fit_pass_and_the_method_is_checked():
    config = load_config(None, [*GPT, "--model.vocab_size", "64", "--parallel.cp", "2",
                                "--parallel.cp_method", "a2a", "--model.seq_len", "64",
                                "--training.global_batch_size", "8"])  # fmt: skip
    spec, microbatches = config.check(2)
    assert (spec.cp, spec.dp, spec.cp_method, microbatches) == (2, 1, "a2a", 2)
    with pytest.raises(ValueError, match="'ring', 'allgather' or 'a2a'"):
        load_config(None, ["--parallel.cp_method", "ulysses"])


class _NoPointToPoint(CollectiveCapabilities):
    """A capability table without send/recv (as a vendor's table may declare)."""

    def support(self, op, dtype):
        return Support.NONE if op == "send_recv" else super().support(op, dtype)


def test_a_method_the_backend_cannot_serve_is_refused_naming_it():
    backend = types.SimpleNamespace(name="nop2p", collective=Collective("gloo", _NoPointToPoint()))
    message = (
        "parallel.cp_method ring (cp=2) needs the collective send_recv for bfloat16, which "
        "backend 'nop2p' does not provide; use cp_method allgather or a2a"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_backend_serves(LayoutSpec(cp=2), backend, torch.bfloat16)
    check_backend_serves(LayoutSpec(cp=2, cp_method="allgather"), backend, torch.bfloat16)
    check_backend_serves(LayoutSpec(cp=1), backend, torch.bfloat16)  # no cp: nothing needed
