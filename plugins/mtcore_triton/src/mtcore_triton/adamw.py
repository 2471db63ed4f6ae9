"""AdamW over many tensors in Triton: one launch per group of tensors.

The update is float32 and follows ``mtcore.ops.adamw_step`` operation by operation
(decay, lerp, addcmul, sqrt / bias correction + eps, addcdiv), with the scalar
factors computed on the host in Python floats exactly as the reference does, so
results agree with it to float32 rounding.

Multi-tensor: a small int64 table holds, per tensor, the addresses of its
parameter, gradient and two moments and its length. Program (t, c) of the grid
(tensors, chunks) loads row t, turns the addresses into typed pointers (as
Triton's grouped-GEMM tutorial does) and strides over tensor t's blocks. One
launch serves all tensors whose parameter and gradient dtypes agree (pointer
types are compile-time), so a model with fp32 master weights and bf16 gradients
is one launch per step instead of one per parameter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtcore_triton.launch import DEFAULT_THREADS, num_warps
from mtcore_triton.rounding import store_rounded

BLOCK = 1024  # elements per loop step: 8 per thread of DEFAULT_THREADS
MAX_CHUNK_PROGRAMS = 1024  # programs per tensor; each loops over its share of blocks


@triton.jit
def _adamw_multi(
    table_ptr,
    p_proto,
    g_proto,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bias_correction2_sqrt,
    eps,
    neg_step_size,
    BLOCK: tl.constexpr,
):
    row = table_ptr + tl.program_id(0).to(tl.int64) * 5
    # p_proto/g_proto: the group's first parameter and gradient, for their element types.
    p_ptr = tl.load(row).to(tl.pointer_type(p_proto.dtype.element_ty))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(g_proto.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 4)
    first = tl.program_id(1).to(tl.int64) * BLOCK
    stride = tl.num_programs(1).to(tl.int64) * BLOCK
    for start in range(first, n, stride):
        offs = start + tl.arange(0, BLOCK)
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
    """``mtcore.ops.adamw_step`` in Triton. The registration's guard admits only lists
    the kernel can update in place (contiguous, one device, float32 moments)."""
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(params)):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs must have equal lengths")
    if step < 1:
        raise ValueError(f"step is 1-based (the count after incrementing), got {step}")
    bias_correction1 = 1 - beta1**step
    scalars = (
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        (1 - beta2**step) ** 0.5,
        eps,
        -(lr / bias_correction1),
    )
    groups: dict[tuple[torch.dtype, torch.dtype], list[tuple]] = {}
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.numel():
            groups.setdefault((p.dtype, g.dtype), []).append((p, g, m, v))
    for group in groups.values():
        table = torch.tensor(
            [
                [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel()]
                for p, g, m, v in group
            ],
            dtype=torch.int64,
        ).to(group[0][0].device, non_blocking=True)
        chunks = min(triton.cdiv(max(t[0].numel() for t in group), BLOCK), MAX_CHUNK_PROGRAMS)
        p0, g0 = group[0][0], group[0][1]
        _adamw_multi[(len(group), chunks)](
            table, p0, g0, *scalars, BLOCK=BLOCK, num_warps=num_warps(DEFAULT_THREADS)
        )
