"""T5 v1.1's blocks: relative position bias, attention with it, gated-GELU feed-forward,
and the encoder and decoder layers (pre-norm, RMS norms without bias, no biases).

T5 does not scale the attention logits by ``d^-0.5``: the query projection's init
carries that factor (Mesh TensorFlow's convention, kept by HuggingFace). The logits
get the relative position bias added, which the kernel ``attention`` op has no
argument for, so the attention core here is plain torch in float32 (the reference
op's arithmetic); a fused biased-attention kernel op is future work. Heads are split
over tp (q, k, v column-parallel, the output row-parallel), and so is the bias
table: each rank holds the columns of its heads.

Under context parallelism (``Context.cp``) every attention gathers its keys and values
over the cp group (``gather_sequence``: cp order) and attends this rank's queries to
them; the caller's bias covers those query and key positions, and the causal mask
compares global positions (``cp_positions``).

Weights are drawn whole from ``Context.generator`` with HuggingFace's T5 init
(``initializer_factor`` = ``init_factor``), then sliced for tp.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models.common.layers import CP_TP_STREAM, Context, Norm, linear_kwargs
from mtcore.ops.attention_dropout import keep_mask
from mtcore.parallel.context import CPGroup, cp_order, gather_sequence, local_positions
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPPartition,
    set_tp_partition,
    shard_tensor,
)


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """The bucket of each ``key - query`` distance (Raffel et al. 2020, section 2.1).

    Bidirectional: half the buckets for keys after the query, half for keys at or
    before it. Causal: keys after the query share bucket 0 with distance 0. Within a
    direction, distances below half the buckets get one bucket each and the rest are
    spaced logarithmically up to ``max_distance``, beyond which all share the last.
    """
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    far = (
        exact
        + (
            torch.log(distance.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    far = far.clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """One stack's bias table ``[buckets, heads]`` (this rank's heads' columns), computed
    once per micro-batch and shared by every layer of the stack."""

    def __init__(self, c: Context, name: str, bidirectional: bool):
        super().__init__()
        cfg = c.config
        self.bidirectional, self.device = bidirectional, c.device
        self.buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
        full = torch.empty(cfg.relative_buckets, cfg.num_heads)
        full.normal_(0.0, cfg.init_factor * cfg.hidden_size**-0.5, generator=c.generator(name))
        partition = TPPartition(1, (cfg.num_heads,))
        shard = shard_tensor(full, partition, c.tp.rank, c.tp.size) if c.tp.size > 1 else full
        self.weight = nn.Parameter(shard.to(c.device))
        set_tp_partition(self, "weight", partition)

    def forward(self, query_len: int, key_len: int, query_offset: int = 0) -> Tensor:
        """``[1, heads / tp, query_len, key_len]``; queries start at ``query_offset``
        (a decoding step's position)."""
        query = torch.arange(query_offset, query_offset + query_len, device=self.device)
        return self.between(query, torch.arange(key_len, device=self.device))

    def between(self, query: Tensor, key: Tensor) -> Tensor:
        """``[1, heads / tp, len(query), len(key)]`` for queries and keys at the global
        positions ``query`` and ``key`` (under cp: this rank's queries, keys in cp order)."""
        buckets = relative_position_bucket(
            key[None, :] - query[:, None], self.bidirectional, self.buckets, self.max_distance
        )
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)


def attention_mask(
    sq: int, sk: int, causal: bool, key_padding_mask: Tensor | None, dtype, device,
    positions: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """The additive mask (0 where a query may attend, ``-inf`` elsewhere) and the rows
    that may attend some key (None when every row may).

    The mask is ``[1, 1, sq, sk]`` causal, ``[b, 1, 1, sk]`` padding, ``[b, 1, sq, sk]``
    both, None for neither: far smaller than the ``[b, heads, sq, sk]`` scores, so it is
    cheap to build and is added to them in the same op as the position bias. Only a
    padding mask (or fewer keys than causal queries) can leave a row with no key; its
    mask row is 0 instead of ``-inf`` (finite logits, no NaN), and the caller zeroes the
    row's output (``has_key``). ``positions``: the global positions of the queries and
    keys (context parallel), which the causal mask then compares instead.
    """
    allowed = None
    if causal and positions is not None:  # context parallel: queries and keys out of order
        query, key = positions
        allowed = (key[None, :] <= query[:, None])[None, None]
    elif causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    if allowed is None:
        return None, None
    has_key = None
    if key_padding_mask is not None or sk < sq:
        has_key = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~has_key
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, float("-inf")), has_key


def biased_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    causal: bool,
    key_padding_mask: Tensor | None,
    dropout_p: float = 0.0,
    dropout_seeds: Tensor | None = None,
    positions: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``softmax(q k^T + bias + mask) v`` in float32, unscaled (T5); ``[b, h, sq, d]``.

    ``dropout_p``/``dropout_seeds``: attention-probability dropout with the kernel op's
    coordinate-hashed mask (``mtcore.ops.attention_dropout``). ``positions``: see
    ``attention_mask``.

    ``causal`` aligns the mask to the bottom-right corner (a decoding step's query sees
    every cached key); a query with no key to attend gives 0, as the reference op. The
    masks are additive (``attention_mask``) and join the bias before the scores, so the
    ``[b, h, sq, sk]`` scores see one add and no masked fill, forward or backward."""
    acc = torch.promote_types(q.dtype, torch.float32)
    sq, sk = q.shape[2], k.shape[2]
    mask, has_key = attention_mask(sq, sk, causal, key_padding_mask, acc, q.device, positions)
    if bias is not None:
        bias = bias.to(acc)
        mask = bias if mask is None else bias + mask  # small unless padded self-attention
    logits = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2))
    if mask is not None:
        logits = logits + mask
    probs = torch.softmax(logits, dim=-1)
    if dropout_p > 0:
        keep = keep_mask(dropout_seeds, q.shape[0], sq, sk, dropout_p)
        probs = probs.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    out = torch.matmul(probs, v.to(acc))
    if has_key is not None:
        out = out.masked_fill(~has_key, 0.0)  # [b, h, sq, d]: d wide, not sk
    return out.to(q.dtype)


def _sectioned_init(stds: list[tuple[int, float]]):
    """An init of a fused ``[sum(rows), in]`` weight drawing each row section with its
    own std, from one generator in order (q, k, v or wi_0, wi_1)."""

    def init(t: Tensor, generator: torch.Generator | None) -> None:
        with torch.no_grad():
            for part, (_, std) in zip(t.split([rows for rows, _ in stds]), stds, strict=True):
                part.normal_(0.0, std, generator=generator)

    return init


def _linear(c: Context, generator, stds: list[tuple[int, float]], column: bool, in_features: int):
    kwargs = linear_kwargs(c, generator, 1.0)
    kwargs["init_method"] = _sectioned_init(stds)
    out = sum(rows for rows, _ in stds)
    if column:
        sections = tuple(rows for rows, _ in stds)
        return ColumnParallelLinear(in_features, out, c.tp, sections=sections, **kwargs)
    return RowParallelLinear(in_features, out, c.tp, **kwargs)


class Attention(nn.Module):
    """Self-attention (``cross=False``: fused q|k|v) or cross-attention to the encoder
    output (q from the decoder, fused k|v from the encoder); this rank's heads."""

    def __init__(self, c: Context, generator: torch.Generator, causal: bool, cross: bool = False):
        super().__init__()
        cfg = c.config
        h, d, self.c = cfg.hidden_size, cfg.kv_dim, c
        self.d, self.heads, self.causal, self.cross = d, cfg.num_heads // c.tp.size, causal, cross
        inner = cfg.num_heads * d
        f = cfg.init_factor
        q_std, kv_std = f * (h * d) ** -0.5, f * h**-0.5
        if cross:
            self.q = _linear(c, generator, [(inner, q_std)], True, h)
            self.kv = _linear(c, generator, [(inner, kv_std)] * 2, True, h)
        else:
            self.qkv = _linear(c, generator, [(inner, q_std)] + [(inner, kv_std)] * 2, True, h)
        self.out = _linear(c, generator, [(h, f * inner**-0.5)], False, inner)

    def heads_of(self, x: Tensor) -> Tensor:
        """``[b, s, heads * d]`` -> ``[b, heads, s, d]``."""
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.d).transpose(1, 2)

    def keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's keys and values of the encoder output (computed once when
        decoding)."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self.heads_of(k), self.heads_of(v)

    def forward(
        self,
        x: Tensor,
        bias: Tensor | None,
        key_padding_mask: Tensor | None = None,
        memory: Tensor | None = None,
        cache: dict | None = None,
    ) -> Tensor:
        """``x`` ``[b, s(/tp), h]``; ``memory``: the encoder output (cross-attention).
        ``cache``: a decoding cache (self: the keys and values so far, grown here;
        cross: the encoder's keys and values)."""
        if self.cross:
            q = self.heads_of(self.q(x))
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]
            else:
                k, v = self.keys_values(memory)
                if cache is not None:
                    cache.update(k=k, v=v)
        else:
            q, k, v = (self.heads_of(t) for t in self.qkv(x).chunk(3, dim=-1))
            if cache is not None:
                if "k" in cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                cache.update(k=k, v=v)
        positions = None
        if self.c.cp is not None:  # the whole sequence's keys, in cp order
            k, v = gather_sequence(torch.stack([k, v]), 3, self.c.cp).unbind(0)
            if self.causal:
                positions = cp_positions(q.shape[2] * self.c.cp.size, self.c.cp, q.device)
        dropout = self.c.attention_dropout(self.training, self.c.tp.rank * self.heads, self.heads)
        attend = functools.partial(
            biased_attention, causal=self.causal, key_padding_mask=key_padding_mask,
            positions=positions, **dropout,
        )  # fmt: skip
        if self.c.config.recompute == "selective":
            y = checkpoint(attend, q, k, v, bias, backend=self.c.backend)
        else:
            y = attend(q, k, v, bias)
        b, _, s, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


def cp_positions(seq_len: int, cp: CPGroup, device) -> tuple[Tensor, Tensor]:
    """Global positions of this cp rank's queries and of the whole sequence's keys in cp
    order (how ``gather_sequence`` lays them out), for a sequence of ``seq_len``."""
    return (
        local_positions(seq_len, cp.size, cp.rank, device),
        cp_order(seq_len, cp.size, device),
    )


class GatedGelu(nn.Module):
    """``wo(dropout(gelu(wi_0 x) * wi_1 x))`` (Shazeer 2020), tanh GELU as v1.1; wi_0|wi_1
    fused and split over tp by hidden units."""

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg, self.c = c.config, c
        h, f = cfg.hidden_size, cfg.ffn_size
        self.wi = _linear(c, generator, [(f, cfg.init_factor * h**-0.5)] * 2, True, h)
        self.wo = _linear(c, generator, [(h, cfg.init_factor * f**-0.5)], False, f)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.wi(x).chunk(2, dim=-1)
        return self.wo(
            sharded_dropout(self.c, F.gelu(gate, approximate="tanh") * up, self.training)
        )


def sharded_dropout(c: Context, x: Tensor, training: bool) -> Tensor:
    """Dropout of a tensor split over tp (heads or hidden units): each rank holds other
    units, so each draws from its own tensor-parallel stream (under cp, one per cp and
    tp rank: the cp ranks hold other tokens)."""
    if not training or c.config.dropout == 0.0:
        return x
    with c.tracker.fork(CP_TP_STREAM) if c.cp is not None else c.tracker.fork():
        return F.dropout(x, c.config.dropout, training=True)


class EncoderBlock(nn.Module):
    """x + dropout(attn(norm(x))), then x + dropout(ffn(norm(x))); bidirectional."""

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        g = c.generator(f"layers.{index}")
        self.attn_norm, self.attn = Norm(c), Attention(c, g, causal=False)
        self.mlp_norm, self.mlp = Norm(c), GatedGelu(c, g)

    def forward(self, x: Tensor, bias: Tensor, padding_mask: Tensor | None) -> Tensor:
        x = x + self.c.dropout(self.attn(self.attn_norm(x), bias, padding_mask), self.training)
        return x + self.c.dropout(self.mlp(self.mlp_norm(x)), self.training)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, feed-forward; each
    pre-norm with a residual add."""

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        g = c.generator(f"layers.{index}")
        self.attn_norm, self.attn = Norm(c), Attention(c, g, causal=True)
        self.cross_norm, self.cross = Norm(c), Attention(c, g, causal=False, cross=True)
        self.mlp_norm, self.mlp = Norm(c), GatedGelu(c, g)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        bias: Tensor,
        memory_mask: Tensor | None,
        cache: dict | None = None,
    ) -> Tensor:
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        drop = functools.partial(self.c.dropout, training=self.training)
        x = x + drop(self.attn(self.attn_norm(x), bias, cache=self_cache))
        attended = self.cross(self.cross_norm(x), None, memory_mask, memory, cross_cache)
        x = x + drop(attended)
        return x + drop(self.mlp(self.mlp_norm(x)))
