"""Ids outside the vocabulary raise in the embedding and the loss, at every tp size.

At tp 2 the shard masks used to turn such an id into a zero embedding and a silent
ln V loss (issue 13). A fake tp rank (no process group) reaches the check, which
runs before any collective; tests/distributed/test_tensor_parallel.py repeats it
with two real ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.parallel.tensor import TPGroup, VocabParallelEmbedding, vocab_parallel_cross_entropy
from mtcore.parallel.tensor.vocab_check import assert_on_device

V = 10


@pytest.fixture(scope="module")
def backend():
    return select_backend("cpu")


def _groups(backend):
    return {"tp1": TPGroup.single(backend), "tp2_rank1": TPGroup(backend, None, 2, 1)}


@pytest.mark.parametrize("layout", ["tp1", "tp2_rank1"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("bad", [V, 65535, -1])
def test_embedding_raises_on_an_out_of_range_id(backend, layout, sequence_parallel, bad):
    tp = _groups(backend)[layout]
    emb = VocabParallelEmbedding(V, 4, tp, sequence_parallel=sequence_parallel)
    tokens = torch.tensor([[0, 3, bad, V - 1]])
    with pytest.raises(IndexError, match=rf"token id {bad} is outside the vocabulary \[0, {V}\)"):
        emb(tokens)


def test_valid_ids_embed_bitwise_as_torch_does_at_tp1(backend):
    emb = VocabParallelEmbedding(
        V, 6, TPGroup.single(backend), generator=torch.Generator().manual_seed(4)
    )
    tokens = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(5))
    tokens[0, :2] = torch.tensor([0, V - 1])  # both ends of the vocabulary
    assert torch.equal(emb(tokens), F.embedding(tokens, emb.weight))


@pytest.mark.parametrize("layout", ["tp1", "tp2_rank1"])
@pytest.mark.parametrize("bad", [V, -5])
def test_loss_raises_on_an_out_of_range_label(backend, layout, bad):
    tp = _groups(backend)[layout]
    logits = torch.randn(4, V // tp.size)
    with pytest.raises(IndexError, match=rf"label {bad} is outside the vocabulary \[0, {V}\)"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, -100, bad, 2]), tp)


def test_ignored_labels_pass_and_match_torch_at_tp1(backend):
    logits, target = torch.randn(4, V), torch.tensor([0, -100, V - 1, 3])
    loss = vocab_parallel_cross_entropy(logits, target, TPGroup.single(backend))
    assert torch.equal(loss, F.cross_entropy(logits, target, reduction="none"))


def test_device_assertion_checks_the_same_range():
    """The accelerator path (torch._assert_async raises at once on the host)."""
    assert assert_on_device(torch.tensor([0, V - 1]), V, "token id")
    for bad in (V, -1):
        with pytest.raises(RuntimeError, match=rf"a token id is outside the vocabulary \[0, {V}\)"):
            assert_on_device(torch.tensor([0, bad]), V, "token id")
