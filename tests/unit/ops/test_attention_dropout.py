"""Attention-probability dropout of the op: a coordinate-hashed mask, so a split of the
heads over ranks draws one process's masks; the CPU backend serves it through the
reference (SDPA's own dropout is another mask)."""

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.ops import attention
from mtcore.ops.attention_dropout import head_seeds, keep_mask


def _qkv(seed=0, b=2, hq=4, hkv=2, s=16, d=8):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, s, d, generator=g, dtype=torch.float64).requires_grad_()
        for h in (hq, hkv, hkv)
    ]


def test_dropout_changes_the_output_and_is_deterministic_per_seed():
    q, k, v = _qkv()
    seeds = head_seeds(torch.tensor(123), 0, 4)
    plain = attention(q, k, v)
    dropped = attention(q, k, v, dropout_p=0.3, dropout_seeds=seeds)
    assert not torch.allclose(dropped, plain)
    assert torch.equal(dropped, attention(q, k, v, dropout_p=0.3, dropout_seeds=seeds.clone()))
    other = head_seeds(torch.tensor(124), 0, 4)
    assert not torch.equal(dropped, attention(q, k, v, dropout_p=0.3, dropout_seeds=other))
    # p = 0 with seeds is exactly no dropout.
    assert torch.equal(attention(q, k, v, dropout_p=0.0, dropout_seeds=seeds), plain)


def test_heads_split_over_ranks_draw_the_masks_one_process_draws():
    q, k, v = _qkv(1)
    base = torch.tensor(77)
    whole = attention(q, k, v, dropout_p=0.25, dropout_seeds=head_seeds(base, 0, 4))
    for rank in range(2):  # tp=2: heads 2r, 2r+1 and key/value head r
        part = attention(
            q[:, 2 * rank : 2 * rank + 2],
            k[:, rank : rank + 1],
            v[:, rank : rank + 1],
            dropout_p=0.25,
            dropout_seeds=head_seeds(base, 2 * rank, 2),
        )
        assert torch.equal(part, whole[:, 2 * rank : 2 * rank + 2])


def test_kept_share_and_scaling():
    seeds = head_seeds(torch.tensor(5), 0, 8)
    keep = keep_mask(seeds, 4, 64, 64, 0.2)
    assert abs(keep.float().mean().item() - 0.8) < 0.01
    # Every row keeps some and drops some: the hash is not constant along any axis.
    assert keep.any(-1).float().mean() > 0.99 and (~keep).any(-1).float().mean() > 0.99
    # A decoding step (one query over 64 keys) draws the full sequence's last row.
    assert torch.equal(keep_mask(seeds, 4, 1, 64, 0.2), keep[:, :, -1:])
    # Expectation is preserved: over 2000 heads of the same query (each its own seed),
    # the mean of the dropped outputs is the output.
    q, k, v = _qkv(2, b=1, hq=1, hkv=1, s=6, d=4)
    many = q.detach().expand(1, 2000, 6, 4)
    outs = attention(many, k, v, dropout_p=0.5, dropout_seeds=head_seeds(torch.tensor(3), 0, 2000))
    torch.testing.assert_close(outs.mean(1, keepdim=True), attention(q, k, v), atol=0.06, rtol=0)


def test_gradients_flow_through_the_kept_probabilities_only():
    q, k, v = _qkv(3, b=1, hq=1, hkv=1, s=5, d=4)
    seeds = head_seeds(torch.tensor(9), 0, 1)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, dropout_p=0.4, dropout_seeds=seeds), (q, k, v)
    )


def test_the_cpu_backend_serves_dropout_through_the_reference():
    kernels = select_backend("cpu").kernels
    q, k, v = (t.detach().float() for t in _qkv(4))
    seeds = head_seeds(torch.tensor(11), 0, 4)
    got = kernels.attention(q, k, v, True, None, None, None, 0.2, seeds)
    want = attention(q, k, v, dropout_p=0.2, dropout_seeds=seeds)
    assert torch.equal(got, want)
    assert not torch.allclose(kernels.attention(q, k, v), want)


@pytest.mark.parametrize("p, seeds", [(0.1, None), (1.0, torch.zeros(4, dtype=torch.int64))])
def test_bad_dropout_arguments_are_refused(p, seeds):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout"):
        attention(q, k, v, dropout_p=p, dropout_seeds=seeds)
