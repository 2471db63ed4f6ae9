"""Transformer building blocks every family shares, from mtcore's tensor-parallel layers.

``Context`` is what one rank's modules share (config, tp group, backend, RNG
tracker, FP8 recipe); ``Norm``, ``Attention`` and ``MLP`` read their sizes from
``context.config`` (any family config with the usual field names: hidden_size,
num_heads, kv_heads, head_dim, ffn_size, activation, norm, norm_eps, bias,
dropout, init_std, scaled_init, recompute, num_layers; optionally
``gelu_approximate``: "tanh", GPT-2's and the default, or "none", the exact erf
GELU of BERT).

Activations are ``[batch, seq, hidden]``, or the sequence shard
``[batch, seq / tp, hidden]`` between blocks under sequence parallelism (the
column-parallel layers gather the sequence, the row-parallel ones scatter it
back). Under context parallelism (cp > 1) ``seq`` is this rank's share of the
sequence (``mtcore.parallel.context``: two of ``2 * cp`` chunks), attention runs
over the whole sequence through ``context_attention``, and positions are global
(``Context.positions``). Every numerical op goes through ``backend.kernels``
except GELU, which has no kernel op of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.ops.attention_dropout import head_seeds
from mtcore.parallel.context import CPGroup, DocumentIds, context_attention, local_positions
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    TPGroup,
    copy_to_tp,
    mark_sequence_parallel,
    model_parallel_seed,
    normal_init,
)
from mtcore.precision.fp8 import FP8Recipe

# Dropout streams under cp: the tokens differ per cp rank (and per tp rank under sp).
CP_STREAM, CP_TP_STREAM = "context-parallel", "context-and-tensor-parallel"
_CP_SEED_OFFSET, _CP_TP_SEED_OFFSET = 5_000_011, 7_000_003
# Attention-probability dropout draws one seed per layer and forward from a stream of
# its own, equal on every tp (and sp) rank, so its draws follow one process's.
ATTENTION_DROPOUT_STREAM, _ATTENTION_DROPOUT_SEED_OFFSET = "attention-dropout", 9_000_017


@dataclass
class Context:
    """What every module of one rank's model shares."""

    config: object  # the family's config (see the module docstring)
    tp: TPGroup
    backend: object
    tracker: RNGTracker
    sequence_parallel: bool
    device: torch.device
    seed: int
    fp8: FP8Recipe | None = None  # the block linears run FP8 under this recipe
    layout: object = None  # mtcore.parallel.layout.ParallelLayout (MoE layers need its ep group)
    cp: CPGroup | None = None  # context parallelism (None: cp = 1)

    def for_block(self, index: int) -> Context:
        """The context of transformer block ``index``: without FP8 where the recipe
        keeps the first/last blocks in the model dtype."""
        if self.fp8 is None or self.fp8.applies_to_block(index, self.config.num_layers):
            return self
        return dataclasses.replace(self, fp8=None)

    @property
    def kernels(self):
        return self.backend.kernels

    def generator(self, name: str) -> torch.Generator:
        """A generator for the module called ``name``, seeded from (seed, name).

        Each layer draws from its own stream, so a pipeline stage that builds only
        its layers gets the same weights as one process that builds them all.
        """
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def positions(self, start: int, length: int) -> slice | Tensor:
        """Global positions of tokens ``[start, start + length)`` of this rank's
        sequence: a slice at cp = 1, an index of the rank's chunks under cp."""
        if self.cp is None:
            return slice(start, start + length)
        index = local_positions(self.config.seq_len, self.cp.size, self.cp.rank, self.device)
        return index[start : start + length]

    def dropout(self, x: Tensor, training: bool) -> Tensor:
        if not training or self.config.dropout == 0.0:
            return x
        # A sequence shard differs per tp rank and must draw a different mask
        # (tp stream); a replicated tensor must draw the same (default stream).
        # Under cp each cp rank holds other tokens: streams that differ over cp too.
        if self.cp is not None:
            fork = self.tracker.fork(CP_TP_STREAM if self.sequence_parallel else CP_STREAM)
        elif self.sequence_parallel:
            fork = self.tracker.fork()
        else:
            fork = contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.config.dropout, training=True)

    def attention_dropout(self, training: bool, first_head: int, heads: int) -> dict:
        """The attention op's dropout arguments for one forward of one layer: none
        when not training or ``config.attention_dropout`` is 0; else the rate and the
        seeds of this rank's query heads (global ``first_head ..``), from one draw of
        the attention-dropout stream (``mtcore.ops.attention_dropout``)."""
        p = getattr(self.config, "attention_dropout", 0.0)
        if not training or p == 0.0:
            return {}
        with self.tracker.fork(ATTENTION_DROPOUT_STREAM):
            base = torch.randint(0, 2**32, (), device=self.device, dtype=torch.int64)
        return {"dropout_p": p, "dropout_seeds": head_seeds(base, first_head, heads)}


class Norm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) or LayerNorm (Ba et al. 2016), replicated over tp.

    size, eps: None takes the config's hidden size and ``norm_eps`` (a latent's norm
    in multi-head latent attention has its own)."""

    def __init__(self, c: Context, size: int | None = None, eps: float | None = None):
        super().__init__()
        cfg, self.kernels = c.config, c.kernels
        self.rms, self.eps = cfg.norm == "rmsnorm", cfg.norm_eps if eps is None else eps
        size = size or cfg.hidden_size
        self.weight = nn.Parameter(torch.ones(size, device=c.device))
        self.bias = None
        if not self.rms:
            self.bias = nn.Parameter(torch.zeros(size, device=c.device))
        if c.sequence_parallel:  # applied to a sequence shard: partial grads
            for name, _ in self.named_parameters():
                mark_sequence_parallel(self, name)

    def forward(self, x: Tensor) -> Tensor:
        if self.rms:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


def linear_kwargs(c: Context, generator: torch.Generator, std: float) -> dict:
    kwargs = dict(
        bias=c.config.bias,
        sequence_parallel=c.sequence_parallel,
        init_method=normal_init(std),
        generator=generator,
        device=c.device,
    )
    if c.fp8 is not None:
        kwargs["fp8"] = c.fp8
        if c.layout is not None and c.layout.dp_cp.size > 1:  # one FP8 history per replica set
            kwargs["fp8_replicas"] = (c.backend.collective, c.layout.dp_cp.group)
    return kwargs


def out_std(cfg) -> float:
    """GPT-2's scaled init of the projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scaled_init else cfg.init_std


class HeadNorm(nn.Module):
    """RMSNorm over each head's dims (Qwen3's QK-norm): one ``[head_dim]`` weight that
    every head shares. A tp rank sees only its heads, so the weight enters the tp
    region through ``copy_to_tp``: its backward sums the heads' gradients over tp."""

    def __init__(self, c: Context):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.ones(c.config.head_dim, device=c.device))

    def forward(self, x: Tensor) -> Tensor:
        weight = copy_to_tp(self.weight, self.c.tp)
        return self.c.kernels.rms_norm(x, weight, self.c.config.norm_eps)


def rope_rows(rope: tuple[Tensor, Tensor], length: int) -> tuple[Tensor, Tensor]:
    """The rope tables of a call's ``length`` tokens: the first rows of shared tables
    ``[seq, d/2]``, or of per-sample tables ``[b, seq, d/2]`` (positions that restart
    per document, ``GPT.rope_at``)."""
    if rope[0].dim() == 3:
        return rope[0][:, :length], rope[1][:, :length]
    return rope[0][:length], rope[1][:length]


def rotate(kernels, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``kernels.rope`` of ``x [b, s, h, d]``; per-sample tables ``[b, s, d/2]`` fold the
    batch into the sequence (the op's tables are ``[seq, d/2]``, one row per token)."""
    if cos.dim() == 2:
        return kernels.rope(x, cos, sin)
    b, s = x.shape[:2]
    folded = kernels.rope(x.reshape(1, b * s, *x.shape[2:]), cos.flatten(0, 1), sin.flatten(0, 1))
    return folded.view(x.shape)


def attention_documents(documents: DocumentIds | None) -> dict:
    """The attention op's document arguments (none without documents)."""
    return documents.kernel_args() if documents is not None else {}


class Attention(nn.Module):
    """Self-attention with grouped-query heads; this rank holds heads / tp of them.

    causal: decoder (each position sees itself and the past) or bidirectional
    (encoder). ``key_padding_mask`` (bool ``[b, s]``, True = a real token) hides
    padding keys; under cp it covers the whole sequence in cp order
    (``mtcore.parallel.context.gather_key_mask``). With the config's ``qk_norm``
    (Qwen3) q and k are RMS-normalised per head before RoPE. ``rope`` tables are indexed
    by the local sequence (the family takes its rows at ``Context.positions``). A
    config's ``sliding_window`` (Mistral's) shorter than ``seq_len`` limits each query to
    that many keys ending at its own position; a longer one hides nothing and is not passed.
    ``documents`` (packed samples, ``DocumentIds``) limits each query to its own document.
    """

    def __init__(self, c: Context, generator: torch.Generator, causal: bool = True):
        super().__init__()
        cfg, tp = c.config, c.tp
        self.c, self.d, self.causal = c, cfg.head_dim, causal
        window = getattr(cfg, "sliding_window", None)
        self.window = window if causal and window is not None and window < cfg.seq_len else None
        self.heads, self.kv_heads = cfg.num_heads // tp.size, cfg.kv_heads // tp.size
        q, kv = cfg.num_heads * self.d, cfg.kv_heads * self.d
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            q + 2 * kv,
            tp,
            sections=(q, kv, kv),
            **linear_kwargs(c, generator, cfg.init_std),
        )
        self.proj = RowParallelLinear(
            q, cfg.hidden_size, tp, **linear_kwargs(c, generator, out_std(cfg))
        )
        self.q_norm = self.k_norm = None
        if getattr(cfg, "qk_norm", False):
            self.q_norm, self.k_norm = HeadNorm(c), HeadNorm(c)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_padding_mask: Tensor | None = None,
        cache: dict | None = None,
        documents: DocumentIds | None = None,
    ) -> Tensor:
        """``cache``: a decoding cache (one dict per layer, the design of T5's decoder):
        the keys and values of the tokens before ``x``, grown here by ``x``'s. The rope
        tables then start at ``x``'s first position, and the causal mask (and window),
        aligned to the bottom-right corner, lets ``x`` see every cached key."""
        qkv = self.qkv(x)  # [b, s, (heads + 2 kv_heads) d]: local heads, whole sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split(
            [self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1
        )
        q = q.view(b, s, self.heads, self.d)
        k = k.view(b, s, self.kv_heads, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope_rows(rope, s)
            q, k = rotate(self.c.kernels, q, cos, sin), rotate(self.c.kernels, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, s, d]
        v = v.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        if cache is not None:
            if documents is not None:
                raise ValueError("a decoding cache holds one sequence: no document ids with it")
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache.update(k=k, v=v)
        dropout = self.c.attention_dropout(self.training, self.c.tp.rank * self.heads, self.heads)
        if self.c.cp is not None:  # key_padding_mask: the whole sequence's, in cp order
            if dropout:
                raise ValueError("attention_dropout > 0 under context parallelism is not built")
            attend = functools.partial(
                context_attention, cp=self.c.cp, kernels=self.c.kernels, causal=self.causal,
                key_padding_mask=key_padding_mask, window=self.window, documents=documents,
            )  # fmt: skip
        else:
            attend = functools.partial(
                self.c.kernels.attention, causal=self.causal, key_padding_mask=key_padding_mask,
                window=self.window, **dropout, **attention_documents(documents),
            )  # fmt: skip
        if self.c.config.recompute == "selective":
            y = checkpoint(attend, q, k, v, backend=self.c.backend)
        else:
            y = attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020; fused gate|up projection) or GELU feed-forward."""

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg = c.config
        f, self.c, self.swiglu = cfg.ffn_size, c, cfg.activation == "swiglu"
        self.gelu_approximate = getattr(cfg, "gelu_approximate", "tanh")
        sections = (f, f) if self.swiglu else (f,)
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            sum(sections),
            c.tp,
            sections=sections,
            **linear_kwargs(c, generator, cfg.init_std),
        )
        self.fc2 = RowParallelLinear(
            f, cfg.hidden_size, c.tp, **linear_kwargs(c, generator, out_std(cfg))
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = (
            self.c.kernels.swiglu(h)
            if self.swiglu
            else F.gelu(h, approximate=self.gelu_approximate)
        )
        return self.fc2(h)


def make_context(config, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None) -> Context:
    """Seed this rank's RNG streams (``model_parallel_seed``) and describe its model.

    fp8: run the transformer blocks' linears in FP8 under this recipe.
    """
    tp = TPGroup.from_layout(layout, backend)
    tracker = model_parallel_seed(seed, layout, backend)
    sp = layout.spec.sequence_parallel and tp.size > 1
    device = backend.torch_device()
    cp = CPGroup.from_layout(layout, backend)
    if getattr(config, "attention_dropout", 0.0) > 0:
        stage = 100 * layout.pp_rank
        tracker.add(ATTENTION_DROPOUT_STREAM, seed + _ATTENTION_DROPOUT_SEED_OFFSET + stage)
    if cp is not None:  # dropout streams that differ over cp (and over tp under sp)
        stage = 100 * layout.pp_rank
        tracker.add(CP_STREAM, seed + _CP_SEED_OFFSET + stage + cp.rank)
        tracker.add(CP_TP_STREAM, seed + _CP_TP_SEED_OFFSET + stage + cp.rank * tp.size + tp.rank)
    return Context(config, tp, backend, tracker, sp, device, seed, fp8, layout=layout, cp=cp)


def single_context(config, backend=None, seed: int = 0) -> Context:
    """The context of a one-process model (tp=1) on ``backend`` (default: selected)."""
    if backend is None:
        from mtcore.backend import select_backend

        backend = select_backend()
    from mtcore.parallel.layout import ParallelLayout

    return make_context(config, ParallelLayout.single(), backend, seed)
