"""mtcore's side: the trainer's ``Engine`` on the ``cpu`` backend, one step per call.

The family's config from the shared shapes (``GPTConfig(style=...)``, ``BertConfig``,
``T5Config``; MoE as ``GPTConfig(moe=MoESpec(...))``), the layout's groups (its tp
and data-parallel groups' all-reduce, all-gather and reduce-scatter through the cpu
backend's shared-memory channel, as in ``mtcore train``; every other call through gloo), mtcore
AdamW (``DistributedAdamW``, ZeRO-1, for ``dp2-distopt``), 1F1B at pp > 1.
"""

from __future__ import annotations

import contextlib
import os

from .configs import (
    BATCH,
    BETAS,
    DECODER_SEQ,
    EPS,
    HEADS,
    HIDDEN,
    LAYERS,
    LLAMA_KV_HEADS,
    LR,
    SEQ,
    TOP_K,
    VOCAB,
    BenchConfig,
)


def family_config(cfg: BenchConfig):
    """mtcore's model config for ``cfg`` (dropout 0 everywhere)."""
    if cfg.family == "bert":
        from mtcore.models.bert import BertConfig

        return BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
            seq_len=SEQ, dropout=0.0,
        )  # fmt: skip
    if cfg.family == "t5":
        from mtcore.models.t5 import T5Config

        return T5Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, encoder_layers=LAYERS // 2,
            decoder_layers=LAYERS // 2, num_heads=HEADS, seq_len=SEQ,
            decoder_seq_len=DECODER_SEQ, dropout=0.0,
        )  # fmt: skip
    from mtcore.models.gpt import GPTConfig

    kv = LLAMA_KV_HEADS if cfg.style == "llama" else None
    dense = GPTConfig(
        style=cfg.style, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
        num_heads=HEADS, num_kv_heads=kv, seq_len=SEQ,
    )  # fmt: skip
    if not cfg.experts:
        return dense
    from mtcore.parallel.moe import MoESpec

    moe = MoESpec(
        num_experts=cfg.experts, top_k=TOP_K, ffn_size=dense.ffn_size, topk_then_softmax=True,
        aux_loss="batch", aux_loss_coeff=1e-2, dispatcher="alltoall",
    )  # fmt: skip
    return dense.model_copy(update={"moe": moe})


def ffn_size(cfg: BenchConfig) -> int:
    return family_config(cfg).ffn_size


@contextlib.contextmanager
def _env(name: str, value: str | None):
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class MtcoreSide:
    """``overlap``: ``MTCORE_TP_OVERLAP`` for this side's steps (None: as set);
    ``shm``: ``MTCORE_SHM_COLLECTIVES`` when the tp group is made."""

    def __init__(self, ctx, cfg: BenchConfig, overlap: str | None = None, shm: str = "1"):
        from mtcore.backend.collective import SHARED_MEMORY_ENV
        from mtcore.parallel.layout import LayoutSpec, ParallelLayout
        from mtcore.training.config import OptimizerConfig
        from mtcore.training.engine import Engine

        spec = LayoutSpec(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, ep=cfg.ep, sequence_parallel=cfg.sp)
        with _env(SHARED_MEMORY_ENV, shm):
            layout = ParallelLayout.build(spec, ctx.backend.collective, ctx.rank, ctx.world_size)
        opt = OptimizerConfig(
            lr=LR, min_lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, warmup_steps=0,
            max_grad_norm=None,
        )  # fmt: skip
        self.engine = Engine(
            family_config(cfg), layout, ctx.backend, micro_batch_size=cfg.micro_batch,
            num_microbatches=cfg.microbatches, optimizer=opt, seed=0, zero=1 if cfg.zero1 else 0,
        )  # fmt: skip
        self.engine.set_lr(LR)
        self.overlap = overlap
        assert cfg.micro_batch * cfg.microbatches == BATCH

    def step(self, micro_batches: list[dict]) -> float:
        from mtcore.parallel.tensor.linear import OVERLAP_ENV

        with _env(OVERLAP_ENV, self.overlap):
            return self.engine.train_step(micro_batches).loss
