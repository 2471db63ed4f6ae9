"""mtcore's BERT training step against a plain PyTorch BERT loop, one process, side by side.

    .venv/bin/python benchmarks/bench_bert.py [--rounds 20 --steps-per-round 1 --warmup 3]
    .venv/bin/python benchmarks/bench_bert.py --quick      # smoke test, a few seconds

Three configurations train the *same* BERT (post-LN encoder, exact GELU, LayerNorm
eps 1e-12, learned positions and token types, MLM head dense + GELU + LayerNorm +
decoder tied to the word embedding with its own bias, tanh pooler + next-sentence
head; fp32, dropout 0) from the same weights on the same masked batches (padding
to a random length per sequence, 15% of the real tokens masked as mtcore's pair
loader masks them, random pair labels), with the same AdamW hyper-parameters,
warmup + cosine learning rate and global-norm clipping, gradient accumulation over
the micro-batches:

* ``plain torch``: ``PlainBert`` below, written as a PyTorch user would:
  ``nn.Embedding``, ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer``
  (``norm_first=False``, ``activation="gelu"``, ``batch_first=True``, the padding as
  ``src_key_padding_mask``), ``nn.LayerNorm``, ``nn.Linear``, ``F.cross_entropy``
  with ``ignore_index``; ``torch.optim.AdamW`` (torch's default on CPU) and
  ``clip_grad_norm_``. The loss is mtcore's: each term (MLM, pair) summed over a
  micro-batch and divided by its count over the whole step;
* ``mtcore``: the trainer's ``Engine`` step (``mtcore.models.bert`` in
  ``DataParallel`` buffers, the no-pipelining schedule, mtcore AdamW with the
  inf/nan check) on the ``cpu`` backend as shipped (``mtcore doctor``);
* ``mtcore+native``: the same on a backend that also registers torch-native
  LayerNorm and cross-entropy (``F.layer_norm``, ``F.cross_entropy``), besides
  bench_trainer.py's SDPA attention and fused AdamW: the kernels plain torch runs.

Dropout is 0 on both sides: ``nn.TransformerEncoderLayer`` drops in three more
places than BERT's block (attention probabilities, inside the feed-forward, the
sub-layer outputs), so with dropout the two would not compute the same thing.
The script first checks that the three give the same loss from the same weights,
then alternates rounds (each configuration runs ``--steps-per-round`` steps, then
the next), reporting median step times, the ratio of medians to plain torch and
the median of per-round ratios (target: mtcore / plain <= 1.0).
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import torch
import torch.nn.functional as F
from _loops import (
    check_same_loss,
    native_backend,
    one_process_engine,
    plain_adamw,
    plain_step,
)
from _timing import alternate, load_average, report
from torch import nn

from mtcore.backend import KernelImpl, select_backend
from mtcore.models.bert import IGNORE_INDEX, BertConfig
from mtcore.models.bert.data import PairVocab
from mtcore.models.bert.pair_loader import mask_sequence
from mtcore.training.config import OptimizerConfig

OPT = OptimizerConfig(
    lr=1e-4, min_lr=1e-5, betas=(0.9, 0.999), eps=1e-6, warmup_steps=5, weight_decay=0.01,
    max_grad_norm=1.0,
)
TOTAL_STEPS = 1000  # the cosine schedule's length (the benchmark runs only its start)
PAD, CLS, SEP, MASK = 0, 1, 2, 3  # special ids of the synthetic vocabulary


class PlainBert(nn.Module):
    """BERT for pre-training (MLM + NSP) as a PyTorch user writes it."""

    def __init__(self, c: BertConfig):
        super().__init__()
        h, eps = c.hidden_size, c.norm_eps
        self.word = nn.Embedding(c.vocab_size, h)
        self.position = nn.Embedding(c.seq_len, h)
        self.token_type = nn.Embedding(c.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps)
        layer = nn.TransformerEncoderLayer(
            h, c.num_heads, c.ffn_size, dropout=0.0, activation="gelu", layer_norm_eps=eps,
            batch_first=True, norm_first=False,
        )
        self.encoder = nn.TransformerEncoder(layer, c.num_layers, enable_nested_tensor=False)
        self.mlm_dense, self.mlm_norm = nn.Linear(h, h), nn.LayerNorm(h, eps)
        self.mlm_bias = nn.Parameter(torch.zeros(c.vocab_size))  # decoder weight: self.word
        self.pooler, self.pair = nn.Linear(h, h), nn.Linear(h, 2)

    def forward(self, tokens, token_types, padding_mask):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.token_type(token_types) + self.position(positions)
        x = self.encoder(self.embed_norm(x), src_key_padding_mask=~padding_mask)
        mlm = F.linear(self.mlm_norm(F.gelu(self.mlm_dense(x))), self.word.weight, self.mlm_bias)
        return mlm, self.pair(torch.tanh(self.pooler(x[:, 0])))

    def loss(self, batch, mlm_count, pair_count):
        """This micro-batch's share of the step's loss: (MLM sum) / (masked tokens of
        the step) + (pair sum) / (sequences of the step)."""
        mlm, pair = self(batch["tokens"], batch["token_types"], batch["padding_mask"])
        mlm_sum = F.cross_entropy(
            mlm.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        pair_sum = F.cross_entropy(pair, batch["pair_labels"], reduction="sum")
        return mlm_sum / mlm_count + pair_sum / pair_count


# mtcore parameter names -> PlainBert's (regular expressions, applied in turn)
RENAMES = (
    (r"^embed\.word\.", "word."),
    (r"^embed\.(position|token_type)$", r"\1.weight"),
    (r"^embed\.norm\.", "embed_norm."),
    (r"^layers\.(\d+)\.attn\.qkv\.(weight|bias)$", r"encoder.layers.\1.self_attn.in_proj_\2"),
    (r"^layers\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.out_proj."),
    (r"^layers\.(\d+)\.attn_norm\.", r"encoder.layers.\1.norm1."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layers.\1.linear1."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layers.\1.linear2."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"encoder.layers.\1.norm2."),
    (r"^mlm\.bias$", "mlm_bias"),
    (r"^mlm\.(dense|norm)\.", r"mlm_\1."),
)


def plain_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


class PlainLoop:
    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]):
        self.model = PlainBert(config)
        self.model.load_state_dict({plain_name(n): w for n, w in weights.items()}, strict=True)
        self.opt = plain_adamw(self.model, OPT)

    def step(self, step: int, batches: list[dict]) -> float:
        mlm_count = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        pair_count = sum(b["pair_labels"].numel() for b in batches)
        losses = (self.model.loss(batch, mlm_count, pair_count) for batch in batches)
        lr = OPT.lr_at(step, TOTAL_STEPS)
        return plain_step(self.model, self.opt, lr, OPT.max_grad_norm, losses)


class MtcoreLoop:
    def __init__(self, config: BertConfig, backend, micro: int, microbatches: int):
        self.engine = one_process_engine(config, backend, micro, microbatches, OPT)

    def step(self, step: int, batches: list[dict]) -> float:
        self.engine.set_lr(OPT.lr_at(step, TOTAL_STEPS))
        return self.engine.train_step(batches).loss

    def loss(self, batch: dict) -> float:
        """One micro-batch's loss (MLM mean + pair mean), forward only."""
        model = self.engine.chunks[0]
        terms = model.loss(model.stage({}, batch), batch)
        return sum(total / count for total, count in terms.values()).item()


def torch_layer_norm(x, weight, bias, eps=1e-5):
    """``mtcore.ops.layer_norm`` through ``F.layer_norm``."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def torch_cross_entropy(logits, target, ignore_index=-100):
    """``mtcore.ops.cross_entropy`` through ``F.cross_entropy`` (unreduced)."""
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")


NATIVE_EXTRA = (
    KernelImpl("layer_norm", torch_layer_norm, "torch-layer-norm", priority=50),
    KernelImpl("cross_entropy", torch_cross_entropy, "torch-cross-entropy", priority=50),
)


def make_batches(config: BertConfig, steps: int, micro: int, microbatches: int, seed: int = 0):
    """``steps`` lists of ``microbatches`` BERT batches: ``[CLS] A [SEP] B [SEP] [PAD]...``
    with a random real length in [seq/2, seq] and split point, masked by
    ``mtcore.models.bert.pair_loader.mask_sequence`` (15%: 80% [MASK], 10% random, 10% kept)."""
    s, v = config.seq_len, config.vocab_size
    vocab = PairVocab(
        CLS, SEP, MASK, PAD, np.arange(4), np.arange(4, v), np.zeros(v, dtype=bool)
    )
    rng = np.random.default_rng(seed)

    def sequence():
        length = int(rng.integers(max(s // 2, 5), s + 1))
        split = int(rng.integers(2, length - 2))  # the first [SEP]
        tokens = np.full(s, PAD, dtype=np.int64)
        tokens[:length] = rng.integers(4, v, size=length)
        tokens[[0, split, length - 1]] = CLS, SEP, SEP
        types = np.zeros(s, dtype=np.int64)
        types[split + 1 : length] = 1
        masked, labels = mask_sequence(tokens, length, vocab, rng, config.mask_prob)
        return masked, types, np.arange(s) < length, labels, int(rng.integers(2))

    def batch():
        rows = [sequence() for _ in range(micro)]
        keys = ("tokens", "token_types", "padding_mask", "labels", "pair_labels")
        columns = zip(*rows, strict=True)
        return {k: torch.from_numpy(np.stack(c)) for k, c in zip(keys, columns, strict=True)}

    return [[batch() for _ in range(microbatches)] for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each, first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 rounds: smoke test")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.seq, args.vocab = 64, 2, 4, 64, 1024
        args.micro_batch, args.rounds, args.steps_per_round, args.warmup = 2, 3, 1, 1
    torch.set_num_threads(args.threads)
    print(f"load at start: {load_average()}")

    config = BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, seq_len=args.seq, dropout=0.0, pair_task="nsp",
    )
    micro, m = args.micro_batch, args.microbatches
    loops = {
        "mtcore": MtcoreLoop(config, select_backend("cpu"), micro, m),
        "mtcore+native": MtcoreLoop(config, native_backend(NATIVE_EXTRA), micro, m),
    }
    weights = {n: p.detach().clone() for n, p in loops["mtcore"].engine.chunks[0].named_parameters()}
    loops = {"plain torch": PlainLoop(config, weights), **loops}
    batches = make_batches(config, args.warmup + args.rounds * args.steps_per_round, micro, m)

    with torch.no_grad():  # the same loss from the same weights: the same math
        first = batches[0][0]
        counts = (first["labels"] != IGNORE_INDEX).sum(), first["pair_labels"].numel()
        losses = {"plain torch": loops["plain torch"].model.loss(first, *counts).item()}
        losses |= {n: loop.loss(first) for n, loop in loops.items() if n != "plain torch"}
    check_same_loss(losses, "plain torch", rtol=1e-4)

    def step(loop):
        return lambda i: loop.step(i + 1, batches[i])

    steps = {name: step(loop) for name, loop in loops.items()}
    timings = alternate(steps, args.rounds, args.steps_per_round, args.warmup)
    real = sum(int(b["padding_mask"].sum()) for step_batches in batches for b in step_batches)
    tokens_per_step = micro * m * config.seq_len
    print(
        f"\n{config.describe()}, fp32, {tokens_per_step} positions/step "
        f"({real / len(batches) / tokens_per_step:.0%} real), {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.steps_per_round} step(s) after {args.warmup} warm-up"
    )
    report(timings, "plain torch", tokens_per_step)


if __name__ == "__main__":
    main()
