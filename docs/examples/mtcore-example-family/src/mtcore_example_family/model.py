"""A causal gMLP language model built from mtcore's tensor-parallel layers.

Each block is ``x + proj_out(u * mix(v))`` with ``[u | v] = gelu(proj_in(norm(x)))``:
``proj_in`` is column-parallel (each tp rank holds a slice of u and of v),
``mix`` multiplies v by a learned lower-triangular ``[seq, seq]`` matrix per gate
head (each tp rank holds its heads' matrices) and ``proj_out`` is row-parallel
(one all-reduce per block). The causal mask is the only notion of order.

One class is the whole model and each pipeline chunk of it; parameter names are
the whole model's at every layout (``layers.3.mix.weight``). Every weight is drawn
on the host from ``Context.generator(name)``, whole, then sliced for tp, so every
layout starts from the same numbers as one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models import BuiltModel
from mtcore.models.common.layers import (
    Context,
    Norm,
    linear_kwargs,
    make_context,
    out_std,
    single_context,
)
from mtcore.parallel.pipeline import stage_plans
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPPartition,
    VocabParallelEmbedding,
    normal_init,
    set_tp_partition,
    shard_tensor,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from mtcore_example_family.family import IGNORE_INDEX, GMLPConfig


class CausalMix(nn.Module):
    """``out[t] = bias[t] + sum_{s <= t} weight[t, s] v[s]``, per gate head.

    ``weight [heads, seq, seq]`` and ``bias [heads, seq]`` are split over tp by heads;
    the bias starts at one and the weight near zero, so a block starts close to a
    channel MLP and learns to mix tokens (the paper's initialisation).
    """

    def __init__(self, c: Context, generator: torch.Generator):
        super().__init__()
        cfg, tp = c.config, c.tp
        self.local_heads = cfg.gate_heads // tp.size
        weight = torch.empty(cfg.gate_heads, cfg.seq_len, cfg.seq_len)
        normal_init(cfg.init_std)(weight, generator)
        by_heads = TPPartition(0, (cfg.gate_heads,))
        for name, full in (("weight", weight), ("bias", torch.ones(cfg.gate_heads, cfg.seq_len))):
            shard = shard_tensor(full, by_heads, tp.rank, tp.size) if tp.size > 1 else full
            setattr(self, name, nn.Parameter(shard.to(c.device)))
            set_tp_partition(self, name, by_heads)

    def forward(self, v: Tensor) -> Tensor:
        b, s, _ = v.shape  # [b, s, gate / tp]: this rank's heads, the whole sequence
        causal = torch.ones(s, s, dtype=torch.bool, device=v.device).tril()
        weight = self.weight[:, :s, :s].masked_fill(~causal, 0.0)
        mixed = torch.einsum("hts,bshd->bthd", weight, v.view(b, s, self.local_heads, -1))
        return (mixed + self.bias[:, :s].t()[None, :, :, None]).reshape(b, s, -1)


class Block(nn.Module):
    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c = c.for_block(index)
        cfg, g = c.config, c.generator(f"layers.{index}")
        gate = cfg.gate_size
        self.norm = Norm(c)
        self.proj_in = ColumnParallelLinear(
            cfg.hidden_size,
            2 * gate,
            c.tp,
            sections=(gate, gate),
            **linear_kwargs(c, g, cfg.init_std),
        )
        self.mix = CausalMix(c, g)
        self.proj_out = RowParallelLinear(
            gate, cfg.hidden_size, c.tp, **linear_kwargs(c, g, out_std(cfg))
        )

    def forward(self, x: Tensor) -> Tensor:
        u, v = F.gelu(self.proj_in(self.norm(x)), approximate="tanh").chunk(2, dim=-1)
        return x + self.c.dropout(self.proj_out(u * self.mix(v)), self.training)


class GMLP(nn.Module):
    """The whole model (default) or one pipeline chunk: ``layers`` with or without the
    embedding (``first``) and the final norm and output layer (``last``)."""

    def __init__(self, config: GMLPConfig, context: Context | None = None, layers: range | None = None,
                 first: bool = True, last: bool = True, backend=None):  # fmt: skip
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("model.vocab_size is unset: fill it in with config.with_vocab(...)")
        c = context or single_context(config, backend)
        self.config, self.c, self.tp, self.first, self.last = config, c, c.tp, first, last
        layers = range(config.num_layers) if layers is None else layers
        h, v, sp = config.hidden_size, config.vocab_size, c.sequence_parallel
        init = normal_init(config.init_std)
        self.embed = None
        if first:
            self.embed = VocabParallelEmbedding(v, h, c.tp, sequence_parallel=sp, init_method=init,
                                                generator=c.generator("embed"), device=c.device)  # fmt: skip
        self.layers = nn.ModuleDict({str(i): Block(c, i) for i in layers})
        self.norm = self.output = None
        if last:
            self.norm = Norm(c)
            self.output = ColumnParallelLinear(h, v, c.tp, bias=False, sequence_parallel=sp, init_method=init,
                                               generator=c.generator("output"), device=c.device)  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        """tokens ``[b, s]`` (first chunk) or hidden states -> hidden states, or logits
        ``[b, s, vocab / tp]`` on the last chunk."""
        if self.embed is not None:
            x = self.c.dropout(self.embed(x), self.training)
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x)) if self.last else x

    # -- the chunk contract (mtcore.models.family) -------------------------------------
    def stage(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        out = self(batch["tokens"] if self.first else inputs["hidden"])
        return {"logits" if self.last else "hidden": out}

    def loss(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        labels = batch["labels"].flatten()
        losses = vocab_parallel_cross_entropy(outputs["logits"].flatten(0, 1), labels, self.tp)
        return {"lm": (losses.sum(), (labels != IGNORE_INDEX).sum())}

    def metrics(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """Next-token accuracy, from the vocab shards (no gather of the logits)."""
        labels = batch["labels"]
        counted = labels != IGNORE_INDEX
        correct = (vocab_parallel_argmax(outputs["logits"], self.tp) == labels) & counted
        return {"accuracy": (correct.sum(), counted.sum())}

    def tied_copies(self) -> list[nn.Parameter]:
        return []  # nothing is tied across stages

    def own_parameter_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]


def build(config: GMLPConfig, layout, backend, seed: int = 0, fp8=None) -> BuiltModel:
    """This rank's chunks, chunk 0 first: chunk ``c`` of pipeline rank ``r`` is virtual
    stage ``c * pp + r`` and holds the layers ``stage_plans`` gives it."""
    config.check_layout(layout.spec)
    c = make_context(config, layout, backend, seed, fp8)
    plans = stage_plans(config.num_layers, layout.pp, layout.pp_rank, layout.spec.vpp)
    chunks = [GMLP(config, c, p.layers, p.has_embedding, p.has_head) for p in plans]
    return BuiltModel(chunks, c.tracker)
