"""Kernel implementations built on torch's own fused operators.

These are not references: they call torch entry points that each accelerator
backend may route to its own library (flash attention through SDPA, a fused
multi-tensor AdamW, a fused RMSNorm). Device plugins register them, with the
predicates their hardware needs, through the ``mtcore_kernels`` hook. Each has
exactly the parameter names of the reference op it implements.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from mtcore.ops.attention import _check, allowed_keys
from mtcore.ops.loss import check_cross_entropy_args
from mtcore.ops.rope import rope


def sdpa_attention(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention`` through ``F.scaled_dot_product_attention``; a sliding
    ``window`` and document ids become a bool mask (SDPA takes neither). SDPA's
    dropout draws from the device's generator, not the op's coordinate-hashed mask, so
    each registration guards it with ``without_dropout`` (the reference serves
    ``dropout_p > 0``)."""
    if dropout_p > 0:
        raise ValueError("sdpa_attention has no coordinate-hashed dropout: see without_dropout")
    hq, hkv = q.shape[1], k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    if causal and sq == 1 and (window is None or window >= sk):
        causal, window = False, None  # one query in the last position sees every key (decode)
    plain = key_padding_mask is None and window is None and query_documents is None
    if plain and (not causal or sq == sk):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv
        )
    _check(q, k, v, key_padding_mask, causal, window, query_documents, key_documents)
    mask = allowed_keys(
        sq, sk, causal, window, key_padding_mask, q.device, query_documents, key_documents
    )
    mask = mask.expand(q.shape[0], 1, sq, sk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    # The contract gives 0 (not NaN) for queries that may attend no key.
    return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


# What one more SDPA call costs on the CPU, forward and backward, in the work of query-key
# pairs: about a 128-token document's square (benchmarks/bench_document_attention.py,
# docs/results/document_masks.md: fitted over 6 packings, 6k-18k).
PER_DOCUMENT_CALL_PAIRS = 128 * 128


def host_sdpa_attention(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):  # fmt: skip
    """``sdpa_attention`` for the host CPU: a causal self-attention of packed samples runs
    one causal SDPA call per (row, document) instead of one call with a dense mask when
    the query-key pairs it skips outweigh the calls' fixed cost (few, long documents);
    everything else is ``sdpa_attention``."""
    if per_document_pays(q, k, v, causal, key_padding_mask, window, query_documents,
                         key_documents):  # fmt: skip
        return _per_document(q, k, v, scale, query_documents)
    return sdpa_attention(
        q, k, v, causal, key_padding_mask, scale, window, dropout_p, dropout_seeds,
        query_documents, key_documents,
    )  # fmt: skip


def per_document_pays(
    q, k, v, causal, key_padding_mask, window, query_documents, key_documents
) -> bool:
    """Whether ``host_sdpa_attention`` runs this call one document at a time."""
    if query_documents is None or not causal or key_padding_mask is not None or window:
        return False
    if q.shape[2] != k.shape[2] or not torch.equal(query_documents, key_documents):
        return False  # a block of a longer sequence (context parallel), or a cache
    _check(q, k, v, None, causal, None, query_documents, key_documents)
    starts = torch.ones_like(query_documents, dtype=torch.bool)
    starts[:, 1:] = query_documents[:, 1:] != query_documents[:, :-1]
    lengths = torch.bincount(starts.flatten().cumsum(0) - 1)  # each (row, document)'s
    masked_pairs = q.shape[0] * q.shape[2] ** 2
    skipped = masked_pairs - int((lengths * lengths).sum())
    return skipped >= PER_DOCUMENT_CALL_PAIRS * lengths.numel()


def _per_document(q, k, v, scale, documents):
    """Causal SDPA of each document of each row by itself, concatenated back."""
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for row in range(q.shape[0]):
        ids = documents[row]
        bounds = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
        edges = [0, *bounds, ids.numel()]
        pieces = [
            F.scaled_dot_product_attention(
                q[row : row + 1, :, start:end], k[row : row + 1, :, start:end],
                v[row : row + 1, :, start:end], is_causal=True, scale=scale, enable_gqa=gqa,
            )
            for start, end in itertools.pairwise(edges)
        ]  # fmt: skip
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def without_dropout(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
) -> bool:  # fmt: skip
    """``fallback_ok`` of attention kernels without the op's dropout: the reference
    serves calls with ``dropout_p > 0``."""
    return dropout_p == 0


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


class _RmsNorm(torch.autograd.Function):
    """``F.rms_norm``'s forward arithmetic (``x * rsqrt(mean(x^2) + eps) * w``, the same
    bits on the CPU) with a hand-written backward: ``dw = sum(g * n)`` and
    ``dx = r * (g w - n * mean(g w n))`` over the saved ``n = x r``, four passes where
    autograd through torch's composite makes about a dozen kernels."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True).add_(eps))
        normed = x * inv_rms
        ctx.save_for_backward(normed, weight, inv_rms)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        normed, weight, inv_rms = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed).sum(dim=tuple(range(grad.dim() - 1)))
        grad_x = None
        if ctx.needs_input_grad[0]:
            scaled = grad * weight
            mean = (scaled * normed).mean(dim=-1, keepdim=True)
            grad_x = scaled.sub_(normed * mean).mul_(inv_rms)
        return grad_x, grad_w, None


def rms_norm_fp32(x, weight, eps=1e-6):
    """``mtcore.ops.rms_norm`` for float32 (float64) ``x`` and ``weight`` of its dtype:
    ``_RmsNorm``, ``F.rms_norm``'s forward numbers with a shorter backward; any other
    dtypes through ``fused_rms_norm``."""
    if x.dtype not in (torch.float32, torch.float64) or weight.dtype != x.dtype or x.dim() == 0:
        return fused_rms_norm(x, weight, eps)
    if tuple(weight.shape) != (x.shape[-1],):
        return fused_rms_norm(x, weight, eps)  # F.rms_norm raises its own error
    return _RmsNorm.apply(x, weight, eps)


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


def fused_layer_norm_fp32(x, weight, bias, eps=1e-5):
    """``mtcore.ops.layer_norm`` for any dtype through ``F.layer_norm`` on float32 (float64
    for float64) operands: the reference's contract (statistics in float32, one rounding
    of the result) with one fused kernel; for float32 inputs the casts are no-ops."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(
        x.to(acc),
        (x.shape[-1],),
        weight.to(acc),
        None if bias is None else bias.to(acc),
        eps,
    )
    return y.to(x.dtype)


def fused_cross_entropy(logits, target, ignore_index=-100):
    """``mtcore.ops.cross_entropy`` through ``F.cross_entropy(reduction="none")``: one fused
    log-softmax and NLL on float32 (float64) logits, float32 losses, 0 and a zero
    gradient row for ``ignore_index``; a target outside ``[0, V)`` raises, as the
    reference's gather does."""
    check_cross_entropy_args(logits, target)
    acc = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(acc), target, ignore_index=ignore_index, reduction="none")


class _Rope(torch.autograd.Function):
    """The reference rotation with a hand-written backward (the same rotation by ``-angle``).

    Forward is the reference's arithmetic, element for element; backward computes
    ``dx1 = g1 cos + g2 sin``, ``dx2 = g2 cos - g1 sin`` in two products each, where
    autograd through the reference's slices, products and ``cat`` allocates and
    zero-fills a buffer per slice. The tables' gradients, when they require one, are
    ``sum(g1 x1 + g2 x2)`` and ``sum(g2 x1 - g1 x2)`` over batch and heads.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        acc = torch.promote_types(x.dtype, torch.float32)
        half = x.shape[-1] // 2
        xf = x.to(acc)
        x1, x2 = xf[..., :half], xf[..., half:]
        c = cos.to(acc)[None, :, None, :]
        s = sin.to(acc)[None, :, None, :]
        tables_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(c, s, x if tables_grad else None)
        ctx.x_dtype, ctx.table_dtypes = x.dtype, (cos.dtype, sin.dtype)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        c, s, x = ctx.saved_tensors
        g1, g2 = grad.to(c.dtype).chunk(2, dim=-1)
        dx = dcos = dsin = None
        if ctx.needs_input_grad[0]:
            dx = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), dim=-1).to(ctx.x_dtype)
        if x is not None:
            x1, x2 = x.to(c.dtype).chunk(2, dim=-1)
            if ctx.needs_input_grad[1]:
                dcos = (g1 * x1 + g2 * x2).sum(dim=(0, 2)).to(ctx.table_dtypes[0])
            if ctx.needs_input_grad[2]:
                dsin = (g2 * x1 - g1 * x2).sum(dim=(0, 2)).to(ctx.table_dtypes[1])
        return dx, dcos, dsin


def rope_rotation(x, cos, sin):
    """``mtcore.ops.rope`` with a hand-written backward (``_Rope``): the same forward
    numbers, fewer and smaller kernels in backward. torch has no fused rotary kernel
    on the CPU; this is the op's arithmetic in the fewest torch calls."""
    if x.dim() != 4 or x.shape[-1] % 2 or tuple(cos.shape) != (x.shape[1], x.shape[-1] // 2):
        return rope(x, cos, sin)  # the reference raises the op's own error messages
    if tuple(sin.shape) != tuple(cos.shape):
        return rope(x, cos, sin)
    return _Rope.apply(x, cos, sin)


class _SiluGlu(torch.autograd.Function):
    """``F.silu(gate) * up`` with the backward autograd makes for it, written into one
    ``[..., 2n]`` gradient: the same kernels (``silu_backward`` of ``grad * up``, and
    ``grad * silu(gate)``), the same bits, without the ``cat`` of the two halves that
    ``chunk``'s backward makes (a copy of the whole gradient: 12 MB per MoE layer in
    the Megatron benchmark's moe-ep2)."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate, up, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, act = ctx.saved_tensors
        n = gate.shape[-1]
        grad_x = grad.new_empty((*grad.shape[:-1], 2 * n))
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_x[..., :n])
        torch.mul(grad, act, out=grad_x[..., n:])
        return grad_x


def silu_glu_fp32(x):
    """``mtcore.ops.swiglu`` for any dtype: ``F.silu(gate) * up`` on float32 (float64)
    operands, rounded once to ``x.dtype``, as the reference specifies; for float32
    inputs it is ``silu_glu`` (``_SiluGlu``: the same numbers, one buffer in backward)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim [..., 2n], got shape {list(x.shape)}")
    return _SiluGlu.apply(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
