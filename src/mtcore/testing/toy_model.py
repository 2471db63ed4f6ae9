"""A small Llama-style transformer for equivalence tests of every parallel layout.

API (kept small and stable; the data-parallel tests use it too):

* ``ToyConfig(...)``: sizes and switches.
* ``build_toy_model(config, layout, backend, seed) -> ToyModel``; ``model(tokens,
  targets)`` returns the mean loss over non-ignored targets (a scalar, equal on
  every tp rank).
* ``model.finalize_grads()`` after backward (sums sequence-parallel grads of
  replicated parameters over tp; a no-op without SP).
* ``gather_full_params(model, grads=False)``: every parameter (or grad) as its
  full, unsharded tensor keyed by name, to compare with a one-process run.

The same seed gives the same full weights at any tp size (layers draw the full
master weight and slice it). Blocks: pre-norm RMSNorm, attention (fused QKV
column-parallel, RoPE, grouped-query attention kernel, row-parallel output),
SwiGLU MLP (fused gate/up column-parallel, row-parallel down), vocab-parallel
embedding and LM head with vocab-parallel cross-entropy (untied). Hidden
dropout (after embedding, attention and MLP) follows the RNG rule of
``mtcore.parallel.tensor.random``; the attention kernel has no dropout.
Activations are ``[batch, seq, hidden]``; ``[batch, seq / tp, hidden]`` between
blocks under sequence parallel.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.ops import rope_tables
from mtcore.parallel.recompute import check_mode, checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    full_tensors,
    mark_sequence_parallel,
    model_parallel_seed,
    normal_init,
    vocab_parallel_cross_entropy,
)


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the toy model. ``sequence_parallel`` is a no-op at tp=1, so one
    config serves the reference run and the parallel one."""

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 48
    layers: int = 2
    seq: int = 16
    dropout: float = 0.0
    sequence_parallel: bool = False
    recompute: str = "none"  # "none" | "full" | "selective"
    bias: bool = False
    init_std: float = 0.02
    norm_eps: float = 1e-6

    def __post_init__(self):
        check_mode(self.recompute)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0: {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _Ctx:
    """What every block shares: tp group, backend, RNG tracker, switches.

    Shared, not copied, by ``copy.deepcopy(model)``: a copy is a second model
    on the same ranks, streams and backend.
    """

    def __deepcopy__(self, memo):
        return self

    def __init__(self, config, tp, backend, tracker, sp, generator, device):
        self.config, self.tp, self.backend, self.tracker = config, tp, backend, tracker
        self.sp, self.generator, self.device = sp, generator, device
        self.init = normal_init(config.init_std)

    def linear_kwargs(self):
        return dict(
            bias=self.config.bias,
            sequence_parallel=self.sp,
            init_method=self.init,
            generator=self.generator,
            device=self.device,
        )

    def dropout(self, x: Tensor, training: bool) -> Tensor:
        if not training or self.config.dropout == 0.0:
            return x
        # Replicated activations: default stream (same on every tp rank);
        # sequence shards: the tp stream (different per rank).
        fork = self.tracker.fork() if self.sp else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.config.dropout, training=True)


class RMSNorm(nn.Module):
    """Replicated weight; under SP it sees a sequence shard, so its grad is flagged."""

    def __init__(self, c: _Ctx):
        super().__init__()
        self.eps, self.kernels = c.config.norm_eps, c.backend.kernels
        self.weight = nn.Parameter(torch.ones(c.config.hidden, device=c.device))
        if c.sp:
            mark_sequence_parallel(self, "weight")

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """``[b, s(/tp), h]`` -> ``[b, s(/tp), h]``; this rank runs heads/tp query and
    kv_heads/tp key/value heads (the qkv sections keep each query head with its
    GQA key/value head on the same rank)."""

    def __init__(self, c: _Ctx):
        super().__init__()
        cfg, tp = c.config, c.tp
        self.c, self.d = c, cfg.head_dim
        self.heads, self.kv_heads = cfg.heads // tp.size, cfg.kv_heads // tp.size
        q, kv = cfg.heads * self.d, cfg.kv_heads * self.d
        self.qkv = ColumnParallelLinear(
            cfg.hidden, q + 2 * kv, tp, sections=(q, kv, kv), **c.linear_kwargs()
        )
        self.out = RowParallelLinear(q, cfg.hidden, tp, **c.linear_kwargs())

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        qkv = self.qkv(x)  # [b, s, (heads + 2 kv_heads) d] local heads, full sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split(
            [self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1
        )
        rope = self.c.backend.kernels.rope
        q = rope(q.view(b, s, self.heads, self.d), cos, sin).transpose(1, 2)  # [b, h, s, d]
        k = rope(k.view(b, s, self.kv_heads, self.d), cos, sin).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        core = self.c.backend.kernels.attention
        if self.c.config.recompute == "selective":
            o = checkpoint(core, q, k, v, backend=self.c.backend, tracker=self.c.tracker)
        else:
            o = core(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.d))


class MLP(nn.Module):
    """SwiGLU: fused ``[gate | up]`` column-parallel (ffn/tp each), row-parallel down."""

    def __init__(self, c: _Ctx):
        super().__init__()
        cfg = c.config
        self.kernels = c.backend.kernels
        self.fc1 = ColumnParallelLinear(
            cfg.hidden, 2 * cfg.ffn, c.tp, sections=(cfg.ffn, cfg.ffn), **c.linear_kwargs()
        )
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, c.tp, **c.linear_kwargs())

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.kernels.swiglu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual block on ``[b, s, h]`` (``[b, s/tp, h]`` under SP)."""

    def __init__(self, c: _Ctx):
        super().__init__()
        self.c = c
        self.attn_norm, self.attn = RMSNorm(c), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c), MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.c.dropout(self.attn(self.attn_norm(x), cos, sin), self.training)
        return x + self.c.dropout(self.mlp(self.mlp_norm(x)), self.training)


class ToyModel(nn.Module):
    """Embedding, ``layers`` blocks, final norm, LM head and loss; see the module doc."""

    def __init__(self, c: _Ctx):
        super().__init__()
        cfg = c.config
        self.c, self.config, self.tp, self.tracker = c, cfg, c.tp, c.tracker
        self.sequence_parallel = c.sp
        self.embed = VocabParallelEmbedding(
            cfg.vocab,
            cfg.hidden,
            c.tp,
            sequence_parallel=c.sp,
            init_method=c.init,
            generator=c.generator,
            device=c.device,
        )
        self.layers = nn.ModuleList(Block(c) for _ in range(cfg.layers))
        self.norm = RMSNorm(c)
        self.head = ColumnParallelLinear(
            cfg.hidden, cfg.vocab, c.tp, **{**c.linear_kwargs(), "bias": False}
        )
        cos, sin = rope_tables(cfg.seq, cfg.head_dim, device=c.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """tokens, targets: ``[b, s]`` int64 (full sequence on every tp rank) -> mean loss."""
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.c.dropout(self.embed(tokens), self.training)
        for block in self.layers:
            if self.config.recompute == "full":
                x = checkpoint(block, x, cos, sin, backend=self.c.backend, tracker=self.tracker)
            else:
                x = block(x, cos, sin)
        logits = self.head(self.norm(x))  # [b, s, vocab / tp]
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.tp)
        return loss.sum() / (targets != -100).sum().clamp(min=1)

    def finalize_grads(self) -> None:
        """Call after backward, before the optimizer (and before any dp grad reduction)."""
        allreduce_sequence_parallel_grads(self, self.tp)


def build_toy_model(config: ToyConfig, layout, backend, seed: int = 0) -> ToyModel:
    """The toy model for this rank of ``layout``, on ``backend``'s device.

    Seeds the RNG as ``model_parallel_seed(seed, layout, backend)`` does (the
    default stream too); the weights come from their own generator seeded with
    ``seed``, so they do not depend on the layout.
    """
    tp = TPGroup.from_layout(layout, backend)
    for count, what in (
        (config.heads, "heads"),
        (config.kv_heads, "kv_heads"),
        (config.vocab, "vocab"),
        (config.ffn, "ffn"),
    ):
        if count % tp.size:
            raise ValueError(f"{what}={count} is not divisible by tp={tp.size}")
    sp = (config.sequence_parallel or layout.spec.sequence_parallel) and tp.size > 1
    if sp and config.seq % tp.size:
        raise ValueError(f"seq={config.seq} is not divisible by tp={tp.size} (sequence parallel)")
    tracker = model_parallel_seed(seed, layout, backend)
    generator = torch.Generator().manual_seed(seed)
    return ToyModel(_Ctx(config, tp, backend, tracker, sp, generator, backend.torch_device()))


def gather_full_params(model: ToyModel, grads: bool = False) -> dict[str, Tensor | None]:
    """Every parameter (or grad) unsharded over tp, keyed by name; call on every tp rank."""
    return full_tensors(model, model.tp, grads=grads)
