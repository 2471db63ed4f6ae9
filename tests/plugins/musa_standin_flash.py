"""torch_musa's flash-attention ops for the CPU stand-in (``musa_standin``). Not MUSA.

``aten::_scaled_dot_product_attention_flash_musa`` and its backward are defined with
the schemas torch_musa's patched ``native_functions.yaml`` gives them and registered
for PrivateUse1 (what the plugin's probe looks for) and for CPU (the stand-in's "musa"
tensors are CPU tensors). The bodies follow SDP.cpp's contract: output ``[N, H, L, E_v]``,
logsumexp float32 ``[N, H, L]``, an empty dropout mask; a boolean ``attn_mask`` (True =
may attend); ``is_causal`` aligned to the top-left corner (the math path builds
``ones(L, S).tril_()``); the backward recomputes ``P = exp(q.k * scale - lse)`` and returns
``(dq, dk, dv, undefined)``. Like a build whose MUSA version is undefined, they ignore
``scale`` and use ``1/sqrt(head dim)``: an adapter that passes another scale gets
wrong numbers here, as it would there.
"""

from __future__ import annotations

import math

import torch

FORWARD = (
    "_scaled_dot_product_attention_flash_musa(Tensor query, Tensor key, Tensor value, "
    "Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, *, float? scale=None)"
    " -> (Tensor output, Tensor logsumexp, Tensor dropout_mask)"
)
BACKWARD = (
    "_scaled_dot_product_attention_flash_musa_backward(Tensor grad_out, Tensor query, "
    "Tensor key, Tensor value, Tensor output, Tensor logsumexp, Tensor dropout_mask, "
    "bool is_causal, Tensor? attn_mask=None, *, float? scale=None) -> (Tensor grad_query, "
    "Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask)"
)


def _allowed(q, k, attn_mask, is_causal):
    sq, sk = q.shape[-2], k.shape[-2]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril()
    if attn_mask is not None:
        assert attn_mask.dtype == torch.bool, "the stand-in takes boolean masks only"
        allowed = allowed & attn_mask
    return allowed


def _logits(q, k, attn_mask, is_causal):
    scale = 1.0 / math.sqrt(q.shape[-1])  # the scale argument is ignored (see above)
    logits = q.float() @ k.float().transpose(-1, -2) * scale
    return logits.masked_fill(~_allowed(q, k, attn_mask, is_causal), float("-inf")), scale


def flash_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    assert dropout_p == 0.0
    logits, _ = _logits(query, key, attn_mask, is_causal)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.softmax(logits, dim=-1) @ value.float()
    return out.to(query.dtype), lse, torch.empty(0, dtype=torch.bool)


def flash_backward(grad_out, query, key, value, output, logsumexp, dropout_mask, is_causal,
                   attn_mask=None, scale=None):  # fmt: skip
    logits, scale = _logits(query, key, attn_mask, is_causal)
    probs = torch.exp(logits - logsumexp[..., None])
    d_out = grad_out.float()
    rowsum = (d_out * output.float()).sum(-1, keepdim=True)
    d_logits = probs * (d_out @ value.float().transpose(-1, -2) - rowsum)
    dq = d_logits @ key.float() * scale
    dk = d_logits.transpose(-1, -2) @ query.float() * scale
    dv = probs.transpose(-1, -2) @ d_out
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)


def register_flash(standin) -> None:
    """Define both ops (as torch_musa's torch patch does) and register their kernels."""
    standin.flash_defs = torch.library.Library("aten", "FRAGMENT")
    standin.flash_defs.define(FORWARD)
    standin.flash_defs.define(BACKWARD)
    for key in ("PrivateUse1", "CPU"):
        standin.aten_impls.impl("_scaled_dot_product_attention_flash_musa", flash_forward, key)
        standin.aten_impls.impl(
            "_scaled_dot_product_attention_flash_musa_backward", flash_backward, key
        )
