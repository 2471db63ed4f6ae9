"""Reference fused AdamW step (Loshchilov & Hutter, 2019)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of every tensor in the lists, in place.

    Bit-for-bit the update of ``torch.optim.AdamW`` (``amsgrad=False``,
    ``maximize=False``) on float32 tensors, in the same operation order::

        p  *= 1 - lr * weight_decay                 # decoupled weight decay
        m   = lerp(m, g, 1 - beta1)
        v   = v * beta2 + (1 - beta2) * g * g
        p  -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    Args:
        params: parameters (float32 master weights, or another floating dtype,
            in which case the update is computed in float32 and rounded once).
        grads: gradients, same shapes; cast to float32 (they may be bf16).
        exp_avgs, exp_avg_sqs: first and second moments, float32, same shapes;
            updated in place.
        step: the 1-based step count *after* incrementing, shared by all
            tensors (the first call passes 1).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.

    Raises:
        ValueError: on lists of different lengths, mismatched shapes, state not
            float32, or ``step < 1``.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs must have equal lengths, got "
            f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}"
        )
    if step < 1:
        raise ValueError(f"step is 1-based (the count after incrementing), got {step}")

    # Python floats, as torch.optim computes them; a float32 tensor here would
    # round differently and break bit equality.
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1

    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(f"tensor {i}: param, grad and state shapes differ")
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(f"tensor {i}: optimizer state must be float32")
        g = g.float()
        p32 = p if p.dtype == torch.float32 else p.float()
        p32.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p32.addcdiv_(m, denom, value=-step_size)
        if p32 is not p:
            p.copy_(p32)
