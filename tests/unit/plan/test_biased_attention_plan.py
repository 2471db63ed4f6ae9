"""The plan of T5's attention: the relative position bias is added outside the kernel
op, so the fp32 probabilities are kept whatever kernel the backend has, and the
planner counts exactly what ``biased_attention`` saves for its backward."""

from __future__ import annotations

import pytest
import torch

from mtcore.models.t5.blocks import biased_attention
from mtcore.plan.memory import backward_transient_bytes, layer_activation_bytes
from mtcore.plan.shapes import Block

HEADS, SEQ, KEYS, DIM, BATCH = 4, 64, 96, 16, 2


def _saved_score_bytes(dtype: torch.dtype) -> int:
    """Bytes of the distinct tensors shaped like the scores that autograd keeps."""
    q = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(BATCH, HEADS, KEYS, DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(BATCH, HEADS, KEYS, DIM, dtype=dtype, requires_grad=True)
    bias = torch.randn(1, HEADS, SEQ, KEYS)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (SEQ, KEYS) and t.shape[0] == BATCH:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        biased_attention(q, k, v, bias, causal=False, key_padding_mask=None)
    return sum(kept.values())


@pytest.mark.parametrize("dtype,act_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_planned_scores_are_what_biased_attention_keeps(dtype, act_bytes):
    block = Block(
        seq=SEQ, kv_seq=KEYS, hidden=HEADS * DIM, heads=HEADS, kv_heads=HEADS,
        head_dim=DIM, ffn=4 * HEADS * DIM, gated=True, dropout=False, biased_attention=True,
    )  # fmt: skip
    with_scores = layer_activation_bytes(block, BATCH, 1, fused_attention=True, act_bytes=act_bytes)
    without = layer_activation_bytes(
        block, BATCH, 1, recompute="selective", fused_attention=True, act_bytes=act_bytes
    )
    kept = _saved_score_bytes(dtype)
    assert kept == 4 * HEADS * SEQ * KEYS * BATCH  # fp32 probabilities, also under bf16
    assert with_scores - without == kept
    # its softmax's backward holds two more of them (the probabilities' and scores' grads)
    plain = Block(**{**block.__dict__, "biased_attention": False})
    transient = [backward_transient_bytes(b, BATCH, tp=1, ep=1) for b in (block, plain)]
    assert transient[0] - transient[1] == 2 * kept
