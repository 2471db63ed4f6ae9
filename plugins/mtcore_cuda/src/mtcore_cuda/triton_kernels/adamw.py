"""AdamW over many tensors in Triton: one fused read-modify-write per element.

The update is float32 and follows ``mtcore.ops.adamw_step`` operation by operation
(decay, lerp, addcmul, sqrt / bias correction + eps, addcdiv), with the scalar
factors computed on the host in Python floats exactly as the reference does, so
results agree with it to float32 rounding (usually bit for bit).

One launch per tensor: a single launch over all of them needs a device table of
pointers, which the interpreter that tests this file cannot run. Element-wise
AdamW is memory bound, so the cost is launch latency on lists of small tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtcore_cuda.triton_kernels.rounding import store_rounded

BLOCK = 1024


@triton.jit
def _adamw(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bias_correction2_sqrt,
    eps,
    neg_step_size,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + one_minus_beta1 * (g - m)  # torch.lerp for weight < 0.5
    v = v * beta2 + one_minus_beta2 * g * g  # addcmul's order
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p + neg_step_size * m / denom  # addcdiv's order
    store_rounded(p_ptr + offs, p, mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    """``mtcore.ops.adamw_step`` in Triton; the guard (``fits``) admits only lists the
    kernel can update in place (contiguous, same device, float32 state)."""
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(params)):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs must have equal lengths")
    if step < 1:
        raise ValueError(f"step is 1-based (the count after incrementing), got {step}")
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    scalars = (
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2_sqrt,
        eps,
        -(lr / bias_correction1),
    )
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        n = p.numel()
        if n:
            _adamw[(triton.cdiv(n, BLOCK),)](p, g, m, v, n, *scalars, BLOCK=BLOCK)


def fits(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    """Whether every tensor can be updated in place by the kernel."""
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if step < 1 or len({len(t) for t in lists}) != 1 or not params:
        return False
    device = params[0].device
    for p, g, m, v in zip(*lists, strict=True):
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            return False
        if not (p.shape == g.shape == m.shape == v.shape):
            return False
        if any(t.device != device or not t.is_contiguous() for t in (p, g, m, v)):
            return False
        if not (p.is_floating_point() and g.is_floating_point()):
            return False
    return True
