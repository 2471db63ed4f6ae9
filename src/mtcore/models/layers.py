"""The transformer block of the GPT model, from mtcore's tensor-parallel layers.

Activations are ``[batch, seq, hidden]``, or the sequence shard
``[batch, seq / tp, hidden]`` between blocks under sequence parallelism (the
column-parallel layers gather the sequence, the row-parallel ones scatter it
back). Every numerical op goes through ``backend.kernels`` except GELU, which has
no kernel op of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models.config import ModelConfig
from mtcore.parallel.moe import MoELayer
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    TPGroup,
    mark_sequence_parallel,
    normal_init,
)
from mtcore.precision.fp8 import FP8Recipe


@dataclass
class Context:
    """What every module of one rank's model shares."""

    config: ModelConfig
    tp: TPGroup
    backend: object
    tracker: RNGTracker
    sequence_parallel: bool
    device: torch.device
    seed: int
    fp8: FP8Recipe | None = None  # the block linears run FP8 under this recipe
    layout: object = None  # mtcore.distributed.ParallelLayout (MoE layers need its ep group)

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

    def dropout(self, x: Tensor, training: bool) -> Tensor:
        if not training or self.config.dropout == 0.0:
            return x
        # A sequence shard differs per tp rank and must draw a different mask
        # (tp stream); a replicated tensor must draw the same (default stream).
        fork = self.tracker.fork() if self.sequence_parallel else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.config.dropout, training=True)


class Norm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) or LayerNorm (Ba et al. 2016), replicated over tp."""

    def __init__(self, c: Context):
        super().__init__()
        cfg, self.kernels = c.config, c.kernels
        self.rms, self.eps = cfg.norm == "rmsnorm", cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size, device=c.device))
        self.bias = None
        if not self.rms:
            self.bias = nn.Parameter(torch.zeros(cfg.hidden_size, device=c.device))
        if c.sequence_parallel:  # applied to a sequence shard: partial grads
            for name, _ in self.named_parameters():
                mark_sequence_parallel(self, name)

    def forward(self, x: Tensor) -> Tensor:
        if self.rms:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


def _linear_kwargs(c: Context, generator: torch.Generator, std: float) -> dict:
    kwargs = dict(
        bias=c.config.bias,
        sequence_parallel=c.sequence_parallel,
        init_method=normal_init(std),
        generator=generator,
        device=c.device,
    )
    if c.fp8 is not None:
        kwargs["fp8"] = c.fp8
        if c.layout is not None and c.layout.size("dp_cp") > 1:  # one FP8 history per replica set
            kwargs["fp8_replicas"] = (c.backend.collective, c.layout.group("dp_cp"))
    return kwargs


def _out_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init of the projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scaled_init else cfg.init_std


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; this rank holds heads / tp of them."""

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg, tp = c.config, c.tp
        self.c, self.d = c, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_heads // tp.size, cfg.kv_heads // tp.size
        q, kv = cfg.num_heads * self.d, cfg.kv_heads * self.d
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, q + 2 * kv, tp, sections=(q, kv, kv), **_linear_kwargs(c, generator, cfg.init_std)
        )
        self.proj = RowParallelLinear(
            q, cfg.hidden_size, tp, **_linear_kwargs(c, generator, _out_std(cfg))
        )

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        qkv = self.qkv(x)  # [b, s, (heads + 2 kv_heads) d]: local heads, whole sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1)
        q = q.view(b, s, self.heads, self.d)
        k = k.view(b, s, self.kv_heads, self.d)
        if rope is not None:
            cos, sin = rope[0][:s], rope[1][:s]
            q, k = self.c.kernels.rope(q, cos, sin), self.c.kernels.rope(k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, s, d]
        v = v.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        if self.c.config.recompute == "selective":
            y = checkpoint(self.c.kernels.attention, q, k, v, backend=self.c.backend)
        else:
            y = self.c.kernels.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.d))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020; fused gate|up projection) or GELU feed-forward."""

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg = c.config
        f, self.c, self.swiglu = cfg.ffn_size, c, cfg.activation == "swiglu"
        sections = (f, f) if self.swiglu else (f,)
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, sum(sections), c.tp, sections=sections, **_linear_kwargs(c, generator, cfg.init_std)
        )
        self.fc2 = RowParallelLinear(
            f, cfg.hidden_size, c.tp, **_linear_kwargs(c, generator, _out_std(cfg))
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = self.c.kernels.swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    In a MoE layer (``config.is_moe_layer(index)``) ``mlp`` is a ``MoELayer``.
    """

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        g = c.generator(f"layers.{index}")
        self.attn_norm, self.attn = Norm(c), Attention(c, g)
        self.mlp_norm = Norm(c)
        self.mlp = _moe(c, g) if c.config.is_moe_layer(index) else MLP(c, g)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.c.dropout(self.attn(self.attn_norm(x), rope), self.training)
        return x + self.c.dropout(self.mlp(self.mlp_norm(x)), self.training)


def _moe(c: Context, generator: torch.Generator) -> MoELayer:
    """The MoE layer of a block; its experts are split over the layout's ep group."""
    cfg = c.config
    return MoELayer(
        cfg.hidden_size,
        cfg.moe,
        tp=c.tp,
        layout=c.layout,
        backend=c.backend,
        sequence_parallel=c.sequence_parallel,
        generator=generator,
        init_std=cfg.init_std,
        out_std=_out_std(cfg),
        bias=cfg.bias,
        device=c.device,
    )
