"""Kernel implementations built on torch's own fused operators.

These are not references: they call torch entry points that each accelerator
backend may route to its own library (flash attention through SDPA, a fused
multi-tensor AdamW, a fused RMSNorm). Device plugins register them, with the
predicates their hardware needs, through the ``mtcore_kernels`` hook. Each has
exactly the parameter names of the reference op it implements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(q, k, v, causal=True, key_padding_mask=None, scale=None):
    """``mtcore.ops.attention`` through ``F.scaled_dot_product_attention``."""
    hq, hkv = q.shape[1], k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    if key_padding_mask is None and (not causal or sq == sk):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv
        )
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        mask = torch.tril(mask, diagonal=sk - sq)
    mask = mask.expand(q.shape[0], 1, sq, sk)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    # The contract gives 0 (not NaN) for queries that may attend no key.
    return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def fused_adamw_step(
    params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay
):
    """``mtcore.ops.adamw_step`` through torch's fused multi-tensor AdamW kernel."""
    if not params:
        return
    # The kernel reads (never writes) one step tensor per parameter, on its device.
    by_device: dict[torch.device, torch.Tensor] = {}
    steps = [
        by_device.setdefault(p.device, torch.tensor(float(step), device=p.device)) for p in params
    ]
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def fused_rms_norm(x, weight, eps=1e-6):
    """``mtcore.ops.rms_norm`` through ``F.rms_norm`` (a fused kernel on some devices)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_layer_norm(x, weight, bias, eps=1e-5):
    """``mtcore.ops.layer_norm`` through ``F.layer_norm`` (one fused kernel: BERT's
    post-LN blocks run three LayerNorms per layer)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def fused_adamw_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


def silu_glu(x):
    """``mtcore.ops.swiglu`` through ``F.silu`` (one fused activation, no fp32 round trip)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
