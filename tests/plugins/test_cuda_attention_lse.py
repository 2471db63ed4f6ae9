"""mtcore-cuda's attention_lse adapter, on CPU: no GPU runs here.

In a fresh process, torch's own ``aten::_scaled_dot_product_flash_attention`` and its
backward (their real schemas) get CPU kernels written from the op's contract (the
output, the float32 log-sum-exp ``[b, h, sq]``, the sequence bookkeeping; the backward
recomputes the probabilities from the LSE), so the adapter's calls, its 8 padding
columns and its guard run as they would on a GPU. What the CUDA kernels compute is not
checked here: the conformance kit on a GPU does that (docs/ci.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mtcore_cuda")

SCRIPT = textwrap.dedent(
    """
    import json, math, torch
    from mtcore.ops import attention_lse
    from mtcore_cuda.attention import cuda_flash_attention_lse, flash_lse_ok

    seen = []

    def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                scale=None):
        seen.append(("forward", query.shape[-1], scale))
        s = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        logits = query.float() @ key.float().transpose(-1, -2) * s
        if is_causal:
            keep = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
            logits = logits.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(logits, -1)
        out = (torch.softmax(logits, -1) @ value.float()).to(query.dtype)
        empty = torch.empty(0)
        return out, lse, empty, empty, query.shape[2], key.shape[2], empty, empty, empty

    def backward(grad_out, query, key, value, out, logsumexp, cum_q, cum_k, max_q, max_k,
                 dropout_p, is_causal, seed, offset, scale=None):
        seen.append(("backward", query.shape[-1], scale))
        s = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        logits = query.float() @ key.float().transpose(-1, -2) * s
        if is_causal:
            keep = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
            logits = logits.masked_fill(~keep, float("-inf"))
        p = torch.exp(logits - logsumexp[..., None])
        do = grad_out.float()
        ds = p * (do @ value.float().transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
        return ((ds @ key.float() * s).to(query.dtype),
                (ds.transpose(-1, -2) @ query.float() * s).to(key.dtype),
                (p.transpose(-1, -2) @ do).to(value.dtype))

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")

    g = torch.Generator().manual_seed(3)
    diffs = {}
    for name, (sq, sk, causal, scale) in {
        "causal": (6, 6, True, None), "full-gqa": (5, 9, False, None),
        "scale": (6, 6, True, 0.3),
    }.items():
        q = torch.randn(2, 4, sq, 16, generator=g)
        k, v = torch.randn(2, 2, sk, 16, generator=g), torch.randn(2, 2, sk, 16, generator=g)
        d_out, d_lse = torch.randn(2, 4, sq, 16, generator=g), torch.randn(2, 4, sq, generator=g)
        results = []
        for fn in (cuda_flash_attention_lse, attention_lse):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o, lse = fn(*leaves, causal=causal, scale=scale)
            grads = torch.autograd.grad((o, lse), leaves, (d_out, d_lse))
            results.append((o, lse, *grads))
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(*results))
    x = torch.randn(1, 2, 4, 64)
    y = torch.randn(1, 2, 6, 64)
    guard = {
        "d64": flash_lse_ok(x, x, x), "d248": flash_lse_ok(*(torch.randn(1, 1, 2, 248),) * 3),
        "d256": flash_lse_ok(*(torch.randn(1, 1, 2, 256),) * 3),
        "d20": flash_lse_ok(*(torch.randn(1, 1, 2, 20),) * 3),
        "padding": flash_lse_ok(x, x, x, key_padding_mask=torch.ones(1, 4, dtype=torch.bool)),
        "causal-4x6": flash_lse_ok(x, y, y, causal=True),
        "full-4x6": flash_lse_ok(x, y, y, causal=False),
    }
    print(json.dumps({"diffs": diffs, "guard": guard, "seen": seen[:4]}))
    """
)


@pytest.fixture(scope="module")
def facts():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_adapter_matches_the_reference_through_the_lse(facts):
    for case, diff in facts["diffs"].items():
        assert diff < 1e-4, (case, diff)


def test_backward_runs_on_eight_more_columns_with_the_scale_passed(facts):
    (fwd, d, scale), (bwd, d_bwd, scale_bwd) = facts["seen"][:2]
    assert (fwd, d, bwd, d_bwd) == ("forward", 16, "backward", 24)
    assert scale == scale_bwd == pytest.approx(0.25)  # 1/sqrt(16), explicit in both


def test_guard_takes_what_the_flash_op_can(facts):
    assert facts["guard"] == {
        "d64": True,
        "d248": True,
        "d256": False,  # 264 once padded
        "d20": False,  # not a multiple of 8
        "padding": False,  # the op takes no mask
        "causal-4x6": False,  # its causal mask is top-left
        "full-4x6": True,
    }
