"""``attention_lse`` (context parallelism's per-block attention) through torch's CUDA flash
attention, whose forward returns the log-sum-exp.

``aten::_scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal,
return_debug_mask, *, scale)`` returns ``(output, logsumexp, cum_seq_q, cum_seq_k, max_q,
max_k, rng_state, unused, debug_attn_mask)``; its backward takes them back with the
gradient. The op takes no mask, head dims that are multiples of 8 up to 256, and
fp16/bf16 on compute capability 8.0 or newer. The LSE's gradient rides 8 extra head-dim
columns in backward (``mtcore.ops.flash_lse``), so the head dim is at most 248. A block
with a padding mask, a sliding window (this op has no window argument; torch's varlen
``_flash_attention_forward`` has one, not wired), document ids (the varlen op's
``cu_seqlens`` would serve them: not wired, no GPU here could test it), or causal with
fewer queries than keys, goes to the reference (the op's causal mask would be the
top-left one; the contract's is bottom-right). The ``attention`` op with document ids
goes through SDPA with a bool mask (``mtcore.ops.torch_native.sdpa_attention``).
"""

from __future__ import annotations

import torch

from mtcore.ops.flash_lse import FlashKernels, flash_attention_lse

_PAD = 8
_MAX_HEAD_DIM = 256


def _forward(q, k, v, is_causal, mask, scale):
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = (
        torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale
        )
    )
    state = (cum_q, cum_k, max_q, max_k, rng_state, unused)
    return out, lse, state


def _backward(grad_out, q, k, v, out, lse, state, is_causal, mask, scale):
    cum_q, cum_k, max_q, max_k, rng_state, unused = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, rng_state,
        unused, scale=scale,
    )  # fmt: skip


CUDA_FLASH = FlashKernels(_forward, _backward, mask=None, head_pad=_PAD)


def flash_lse_ok(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, query_documents=None,
    key_documents=None,
) -> bool:  # fmt: skip
    d = q.shape[-1]
    return (
        key_padding_mask is None
        and window is None
        and query_documents is None
        and (not causal or q.shape[2] == k.shape[2])
        and v.shape[-1] == d
        and d % _PAD == 0
        and d + _PAD <= _MAX_HEAD_DIM
    )


def cuda_flash_attention_lse(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, query_documents=None,
    key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention_lse`` through torch's CUDA flash-attention kernel (no window,
    no document ids: ``flash_lse_ok`` sends those blocks to the reference)."""
    return flash_attention_lse(
        CUDA_FLASH, q, k, v, causal, key_padding_mask, scale, window, query_documents,
        key_documents,
    )  # fmt: skip
