"""The shapes both sides share, every configuration, and the batches both train on.

One model shape for every configuration (the GPT's since the benchmark began, not
tuned for either side): hidden 256, 8 heads, seq 256, batch 4 per data-parallel rank,
vocab 1024, 4 layers (T5: 2 encoder + 2 decoder layers, the same 4), fp32. A step
is ``BATCH`` rows per data-parallel rank, in ``microbatches`` micro-batches of
``BATCH / microbatches`` rows (pipeline configurations: 4 of 1 row, the batch split
as finely as it goes, so that 1F1B on 2 stages has a steady phase; it needs at least 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 1024, 256, 4, 8, 256, 4
LLAMA_KV_HEADS = 4
DECODER_SEQ = 64  # T5's target length (a quarter of the input, as span corruption gives)
EXPERTS, TOP_K = 8, 2
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8
IGNORE_INDEX = -100
MASK_ID = 3  # BERT's [MASK] in the synthetic vocabulary


@dataclass(frozen=True)
class BenchConfig:
    """One side-by-side configuration. ``zero1``: mtcore's ZeRO-1 (``DistributedAdamW``)
    against Megatron's DDP and its optimizer (see ``megatron_gpt``)."""

    family: str = "gpt"  # gpt, bert, t5
    style: str = "gpt2"  # gpt only: gpt2 or llama
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    sp: bool = False
    experts: int = 0
    microbatches: int = 1
    zero1: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batch(self) -> int:
        return BATCH // self.microbatches

    @property
    def legacy(self) -> bool:
        """The first four configurations: Megatron's model under a plain loop and torch
        AdamW (no DDP), as they were measured since session 1."""
        return self.family == "gpt" and self.pp == self.dp == 1 and not self.experts

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp % self.dp  # rank order tp-dp-pp on both sides


CONFIGS = {
    "tp1": BenchConfig(),
    "tp2": BenchConfig(tp=2),
    "tp2-sp": BenchConfig(tp=2, sp=True),
    "llama-tp2": BenchConfig(tp=2, style="llama"),
    "pp2": BenchConfig(pp=2, microbatches=4),
    "pp2-tp2": BenchConfig(tp=2, pp=2, microbatches=4),
    "moe-ep2": BenchConfig(style="llama", dp=2, ep=2, experts=EXPERTS),
    "bert-tp2": BenchConfig(family="bert", tp=2),
    "t5-tp2": BenchConfig(family="t5", tp=2),
    "dp2-distopt": BenchConfig(dp=2, zero1=True),
}
DEFAULT_CONFIGS = ("tp1", "tp2", "tp2-sp", "llama-tp2")


def learnable_rows(n: int, rows: int) -> torch.Tensor:
    """``[n, rows, seq + 1]`` token rows that follow a fixed random permutation of the
    vocabulary (``next = perm[current]``) from random starts: a loss that can fall from
    ln V towards 0 (uniform random tokens would keep both sides at ln V)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(VOCAB, generator=g)
    tokens = [torch.randint(0, VOCAB, (n, rows), generator=g)]
    for _ in range(SEQ):
        tokens.append(perm[tokens[-1]])
    return torch.stack(tokens, dim=-1)


def _bert_batch(rows: torch.Tensor, g: torch.Generator) -> dict:
    tokens = rows[:, :SEQ].clone()
    masked = torch.rand(tokens.shape, generator=g) < 0.15
    labels = torch.where(masked, tokens, IGNORE_INDEX)
    tokens[masked] = MASK_ID
    types = torch.zeros_like(tokens)
    types[:, SEQ // 2 :] = 1
    pair = torch.randint(0, 2, (tokens.shape[0],), generator=g)
    return {"tokens": tokens, "token_types": types, "labels": labels, "pair_labels": pair}


def _t5_batch(rows: torch.Tensor) -> dict:
    return {
        "tokens": rows[:, :SEQ].contiguous(),
        "decoder_tokens": rows[:, :DECODER_SEQ].contiguous(),
        "labels": rows[:, 1 : DECODER_SEQ + 1].contiguous(),
    }


def step_batches(cfg: BenchConfig, steps: int, dp_rank: int) -> list[list[dict]]:
    """Per step, this data-parallel rank's micro-batches in mtcore's names (``tokens``,
    ``labels``; BERT: ``token_types``, MLM ``labels`` with 15% of the tokens masked,
    ``pair_labels``; T5: ``decoder_tokens``). Every rank draws the whole global batch
    and keeps its rows, so both sides see the same rows on the same rank."""
    data = learnable_rows(steps, BATCH * cfg.dp)
    g = torch.Generator().manual_seed(1)
    out = []
    for rows in data:
        mine = rows[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        micro = []
        for part in mine.split(cfg.micro_batch):
            if cfg.family == "bert":
                micro.append(_bert_batch(part, g))
            elif cfg.family == "t5":
                micro.append(_t5_batch(part))
            else:
                micro.append(
                    {"tokens": part[:, :-1].contiguous(), "labels": part[:, 1:].contiguous()}
                )
        out.append(micro)
    return out
