"""Model-parallel RNG streams and activation recompute, in one process.

Recompute must give the *same* numbers as no recompute, dropout included:
loss, every grad, and where the RNG streams stand afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import TP_STREAM, RNGTracker, model_parallel_seed

SIZES = dict(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=16, bias=True, init_std=0.1,
)  # fmt: skip


@pytest.fixture(scope="module")
def backend():
    return select_backend("cpu")


def test_fork_draws_from_its_own_stream_and_leaves_the_default_alone(backend):
    tracker = model_parallel_seed(11, ParallelLayout.single(), backend)
    a = torch.rand(8)
    with tracker.fork():
        t1 = torch.rand(8)
    b = torch.rand(8)
    with tracker.fork():
        t2 = torch.rand(8)  # the stream continues where it stopped
    model_parallel_seed(11, ParallelLayout.single(), backend)
    assert torch.equal(torch.cat([a, b]), torch.rand(16))
    fresh = RNGTracker(backend.device)
    fresh.add(TP_STREAM, 11 + 2718)
    with fresh.fork():
        assert torch.equal(torch.cat([t1, t2]), torch.rand(16))
    assert not torch.equal(t1, a)


def test_tracker_states_round_trip_and_errors(backend):
    tracker = RNGTracker(backend.device)
    before = torch.get_rng_state()
    tracker.add("x", 5)
    assert torch.equal(torch.get_rng_state(), before), "add() must not move any stream"
    saved = tracker.get_states()
    with tracker.fork("x"):
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("x"):
        assert torch.equal(torch.rand(4), first)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("x", 6)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("y", 5)
    with pytest.raises(KeyError, match="not added"), tracker.fork("nope"):
        pass


def _tokens_and_targets(cfg: GPTConfig):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    return tokens, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)


def _step(backend, recompute: str):
    cfg = GPTConfig(dropout=0.3, recompute=recompute, **SIZES)
    (model,) = build_gpt(cfg, ParallelLayout.single(), backend, seed=3)
    loss = model(*_tokens_and_targets(cfg))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, torch.get_rng_state(), model.c.tracker.get_states()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_numbers_with_dropout(backend, mode):
    loss, grads, rng, tracked = _step(backend, "none")
    loss_r, grads_r, rng_r, tracked_r = _step(backend, mode)
    assert torch.equal(loss, loss_r)
    for name, g in grads.items():
        assert torch.equal(g, grads_r[name]), name
    assert torch.equal(rng, rng_r), "recompute moved the default stream"
    assert all(torch.equal(tracked[k], tracked_r[k]) for k in tracked)


def test_dropout_is_on_in_the_recompute_test(backend):
    """Guard: the test above compares runs in which dropout really draws masks."""
    loss_a = _step(backend, "none")[0]
    cfg = GPTConfig(dropout=0.0, **SIZES)
    torch.manual_seed(0)
    (model,) = build_gpt(cfg, ParallelLayout.single(), backend, seed=3)
    assert not torch.equal(loss_a, model(*_tokens_and_targets(cfg)).detach())


def test_checkpoint_restores_the_tracked_stream(backend):
    """A checkpointed function that drops out in the tp stream recomputes the same mask."""
    tracker = RNGTracker(backend.device)
    tracker.add(TP_STREAM, 77)

    def fn(x):
        with tracker.fork():
            y = F.dropout(x, 0.5)
        return F.dropout(y, 0.5) * 2

    grads = []
    for use_checkpoint in (False, True):
        tracker.set_states({TP_STREAM: _seed_state(backend, 77)})
        torch.manual_seed(1)
        x = torch.ones(64, requires_grad=True)
        out = checkpoint(fn, x, backend=backend, tracker=tracker) if use_checkpoint else fn(x)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def _seed_state(backend, seed):
    t = RNGTracker(backend.device)
    t.add("s", seed)
    return t.get_states()["s"]
