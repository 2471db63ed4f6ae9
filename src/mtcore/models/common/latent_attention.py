"""Multi-head latent attention (MLA, DeepSeek-V2, arXiv 2405.04434), tensor parallel over heads.

Keys and values come from one low-rank latent per token, ``c_kv = RMSNorm(x W_dkv)``
(``kv_lora_rank`` wide), expanded per head by ``W_ukv`` into the un-rotated key part
(``qk_nope_head_dim``) and the value (``v_head_dim``). Rotary position lives in a
decoupled part: ``qk_rope_head_dim`` extra key dims computed from ``x`` once and shared
by every head, and as many extra query dims per head. Queries are compressed too
(``q_lora_rank``; None: one plain projection)::

    q      = W_uq RMSNorm(x W_dq)   (heads x [nope | rope])     or  x W_q
    c_kv, k_rope = x W_dkv                                      (latent | shared rope key)
    k, v   = W_ukv RMSNorm(c_kv)    (heads x [nope | v])
    out    = W_o attention([q_nope | rope(q_rope)], [k_nope | rope(k_rope)], v)

Tensor parallel (Megatron-Core's split): the down-projections ``q_down``/``kv_down``
and the latent norms are replicated, the up-projections column-parallel over heads,
``proj`` row-parallel. Under sequence parallel the down-projections run on this
rank's sequence shard (their weights flagged sequence-parallel: partial grads) and
the up-projections gather the sequence; the shared rope key enters the tp region by
``gather_from_sp`` (else ``copy_to_tp``), whose backward sums the heads' grads.

Attention goes through the kernel op (or ``context_attention`` under cp) with
queries and keys of ``qk_nope + qk_rope`` dims and values of ``v_head_dim``: the
narrower side is padded with zeros to one head size (zeros add nothing to a dot
product, and padded value columns come out zero and are dropped). The softmax scale
``1 / sqrt(qk_head_dim)`` (times YaRN's ``mscale^2`` when the RoPE asks) is folded
into the queries, so every attention kernel and cp method serves MLA unchanged.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models.common.latent_spec import MLASpec, softmax_scale
from mtcore.models.common.layers import (
    Context,
    Norm,
    attention_documents,
    linear_kwargs,
    out_std,
    rope_rows,
    rotate,
)
from mtcore.parallel.context import DocumentIds, context_attention
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp,
    gather_from_sp,
    mark_sequence_parallel,
    normal_init,
)
from mtcore.parallel.tensor.weight_grad import linear


class ReplicatedLinear(nn.Module):
    """``x W^T`` with ``W [out, in]`` whole on every tp rank (drawn whole from ``generator``).

    Under sequence parallel it sees this rank's sequence shard, so its gradient is
    partial and flagged for the sum over tp (``mark_sequence_parallel``). Under a
    zero-bubble schedule its weight gradient waits for W, as the parallel linears' do
    (``mtcore.parallel.tensor.weight_grad.linear``)."""

    def __init__(self, c: Context, in_features: int, out_features: int, generator, std: float):
        super().__init__()
        weight = torch.empty(out_features, in_features)
        normal_init(std)(weight, generator)
        self.weight = nn.Parameter(weight.to(c.device))
        if c.sequence_parallel:
            mark_sequence_parallel(self, "weight")

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; this rank holds ``num_heads / tp`` heads."""

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg, tp = c.config, c.tp
        spec: MLASpec = cfg.mla
        self.c, self.spec, self.heads = c, spec, cfg.num_heads // tp.size
        h, std = cfg.hidden_size, cfg.init_std
        qk, heads = spec.qk_head_dim, cfg.num_heads
        latent_norm = dict(size=None, eps=spec.latent_norm_eps)
        column = linear_kwargs(c, generator, std) | {"bias": False}
        if spec.q_lora_rank is None:
            self.q = ColumnParallelLinear(h, heads * qk, tp, **column)
        else:
            self.q_down = ReplicatedLinear(c, h, spec.q_lora_rank, generator, std)
            self.q_norm = Norm(c, **{**latent_norm, "size": spec.q_lora_rank})
            self.q_up = ColumnParallelLinear(spec.q_lora_rank, heads * qk, tp, **column)
        self.kv_down = ReplicatedLinear(
            c, h, spec.kv_lora_rank + spec.qk_rope_head_dim, generator, std
        )
        self.kv_norm = Norm(c, **{**latent_norm, "size": spec.kv_lora_rank})
        kv_out = heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        self.kv_up = ColumnParallelLinear(spec.kv_lora_rank, kv_out, tp, **column)
        self.proj = RowParallelLinear(
            heads * spec.v_head_dim, h, tp, **linear_kwargs(c, generator, out_std(cfg))
        )
        self.attention_dim = max(qk, spec.v_head_dim)
        # The kernel scales by 1 / sqrt(its head size): fold the wanted scale into q.
        self.q_factor = softmax_scale(spec, cfg.rope_scaling) * math.sqrt(self.attention_dim)

    def queries(self, x: Tensor) -> Tensor:
        """``[b, s, heads_local, qk_head_dim]``."""
        q = self.q(x) if self.spec.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        return q.view(*q.shape[:2], self.heads, self.spec.qk_head_dim)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, cache: dict | None = None,
        documents: DocumentIds | None = None,
    ) -> Tensor:  # fmt: skip
        """``cache``: a decoding cache, one dict per layer as ``Attention``'s (the rope
        tables then start at ``x``'s first position). MLA keeps, per token, the normed
        latent (``"latent"``, ``[b, t, kv_lora_rank]``) and the rotated shared rope key
        (``"k_rope"``, ``[b, t, qk_rope_head_dim]``) instead of per-head keys and values,
        grows them by ``x``'s, and expands all of them through ``kv_up`` each step.
        ``documents``: packed samples' document ids (``Attention``'s)."""
        spec, c, kernels = self.spec, self.c, self.c.kernels
        q = self.queries(x)
        b, s = q.shape[:2]
        cos, sin = rope_rows(rope, s)
        latent, k_rope = self.kv_down(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], -1)
        latent = self.kv_norm(latent)
        # The shared rope key feeds every local head: its grad sums over tp.
        k_rope = gather_from_sp(k_rope, c.tp) if c.sequence_parallel else copy_to_tp(k_rope, c.tp)
        k_rope = rotate(kernels, k_rope.unsqueeze(2), cos, sin).squeeze(2)
        if cache is not None:
            if documents is not None:
                raise ValueError("a decoding cache holds one sequence: no document ids with it")
            if "latent" in cache:
                latent = torch.cat([cache["latent"], latent], 1)
                k_rope = torch.cat([cache["k_rope"], k_rope], 1)
            cache.update(latent=latent, k_rope=k_rope)
        t = k_rope.shape[1]  # keys: the cached tokens and these
        kv = self.kv_up(latent).view(b, t, self.heads, -1)
        k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], -1)
        q_nope, q_rope = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], -1)
        q_rope = rotate(kernels, q_rope, cos, sin)
        k_rope = k_rope.unsqueeze(2).expand(b, t, self.heads, -1)
        q = torch.cat([q_nope, q_rope], -1) * self.q_factor
        k = torch.cat([k_nope, k_rope], -1)
        q, k, v = (_pad_last(t, self.attention_dim).transpose(1, 2) for t in (q, k, v))
        if c.cp is not None:
            attend = functools.partial(
                context_attention, cp=c.cp, kernels=kernels, causal=True, documents=documents
            )
        else:
            attend = functools.partial(
                kernels.attention, causal=True, **attention_documents(documents)
            )
        if c.config.recompute == "selective":
            y = checkpoint(attend, q, k, v, backend=c.backend)
        else:
            y = attend(q, k, v)
        y = y[..., : spec.v_head_dim].transpose(1, 2).reshape(b, s, self.heads * spec.v_head_dim)
        return self.proj(y)


def _pad_last(t: Tensor, size: int) -> Tensor:
    return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))
