"""mtcore's T5 training step against a plain PyTorch encoder-decoder loop, and T5 at pp2.

    .venv/bin/python benchmarks/bench_t5.py [--rounds 10 --warmup 2] [--m 4 8 --reps 5]
    .venv/bin/python benchmarks/bench_t5.py --quick      # smoke test, a few seconds

**Side by side, one process** (``--skip-pipeline`` for this part alone). Three
configurations train the *same* T5 v1.1 (configs/t5.yaml's sizes: hidden 128, 2 + 2
layers, 4 heads, gated-GELU 256, 32 relative buckets, untied head; fp32, dropout 0)
from the same weights on the same span-corrupted batches (random token pieces of a
random length, corrupted by ``mtcore.models.t5.data``: noise 0.15, mean span 3, sentinels,
padding), with the same AdamW, warmup + cosine learning rate, clipping and gradient
accumulation over the micro-batches:

* ``plain torch``: ``PlainT5`` below, as a PyTorch user writes T5 (the way
  HuggingFace's ``T5Attention`` does it): ``nn.Embedding``, ``nn.RMSNorm``,
  ``nn.Linear`` without bias (q|k|v and wi_0|wi_1 fused, as mtcore fuses them),
  attention as ``softmax(q k^T + position bias + mask) v`` in float32 with two
  ``torch.matmul`` (the relative position bias has no fused kernel; mtcore's attention
  is the same two matmuls, see ``mtcore.models.t5.blocks``), ``F.gelu(tanh) * up``,
  ``F.cross_entropy`` summed and divided by the step's target tokens;
  ``torch.optim.AdamW`` and ``clip_grad_norm_``. The relative-position bucket indices
  come from ``mtcore.models.t5.blocks.relative_position_bucket`` (index arithmetic,
  checked against the paper's table by the unit tests);
* ``mtcore``: the trainer's ``Engine`` step (``mtcore.models.t5`` in ``DataParallel``
  buffers, the no-pipelining schedule, mtcore AdamW) on the ``cpu`` backend as shipped;
* ``mtcore+native``: the same on a backend that also registers ``F.cross_entropy``
  (the cpu backend's cross-entropy is the reference op), bench_bert.py's extra kernel.

``--one-add-attention`` adds a fourth, ``mtcore one-add``: ``mtcore`` with T5's
attention core swapped for ``one_add_attention`` (masks folded into the bias, one add),
an experiment that sizes the cost of ``biased_attention``'s masked fills.

The script checks that they give the same loss from the same weights, then
alternates rounds and reports medians, the ratio of medians and the median of
per-round ratios against plain torch (target: mtcore / plain <= 1.0).

**Pipeline, pp=2** (gloo, one thread per rank): the same model under 1F1B with the
encoder on stage 0 and the decoder on stage 1 (the split at the boundary; the
encoder output travels with the decoder's hidden states). Each ``Engine.train_step``'s
runner step is timed between two barriers; per stage:

* **1F1B theory, equal stages**: ``(p-1)/(m+p-1)``;
* **1F1B theory, this split**: the action lists simulated (``simulate``) with each
  stage's median forward and backward time: the idle share that the encoder/decoder
  imbalance alone gives, steady compute assumed;
* **replay**: the same with every compute action's measured time (noise included);
* **measured**: ``1 - busy / window`` (busy: the runner's compute time).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from _loops import check_same_loss, native_backend, one_process_engine, plain_adamw, plain_step
from _timing import alternate, load_average, report
from bench_bert import torch_cross_entropy
from torch import nn

from mtcore.backend import KernelImpl, select_backend
from mtcore.models.t5 import T5Config
from mtcore.models.t5.blocks import relative_position_bucket
from mtcore.models.t5.data import corrupt, noise_mask
from mtcore.models.t5.model import IGNORE_INDEX
from mtcore.models.t5.spans import lengths_of, span_lengths
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig

OPT = OptimizerConfig(
    lr=2e-3, min_lr=2e-4, betas=(0.9, 0.999), eps=1e-8, warmup_steps=5, weight_decay=0.01,
    max_grad_norm=1.0,
)  # fmt: skip
TOTAL_STEPS = 300  # the cosine schedule's length (configs/t5.yaml's steps)
PAD, EOS, SENTINELS = 0, 1, 100  # the synthetic vocabulary: sentinels are its last ids
NATIVE_EXTRA = (
    KernelImpl("cross_entropy", torch_cross_entropy, "torch-cross-entropy", priority=50),
)


class PlainAttention(nn.Module):
    """T5 attention, no logit scaling: ``bias`` is added to the scores (the position bias
    with the causal or padding mask in it for self-attention, the padding mask alone for
    cross-attention)."""

    def __init__(self, c: T5Config, cross: bool):
        super().__init__()
        h, inner = c.hidden_size, c.num_heads * c.kv_dim
        self.heads, self.cross = c.num_heads, cross
        if cross:
            self.q, self.kv = nn.Linear(h, inner, bias=False), nn.Linear(h, 2 * inner, bias=False)
        else:
            self.qkv = nn.Linear(h, 3 * inner, bias=False)
        self.out = nn.Linear(inner, h, bias=False)

    def split_heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, -1).transpose(1, 2)

    def forward(self, x, bias, memory=None):
        if self.cross:
            q, (k, v) = self.q(x), self.kv(memory).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (self.split_heads(t) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) + bias
        y = torch.matmul(torch.softmax(scores.float(), dim=-1).type_as(v), v)
        b, _, s, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class PlainLayer(nn.Module):
    """An encoder layer (self-attention, feed-forward) or a decoder layer (causal
    self-attention, cross-attention, feed-forward), each sub-layer pre-norm + residual."""

    def __init__(self, c: T5Config, decoder: bool):
        super().__init__()
        h, f = c.hidden_size, c.ffn_size
        self.attn_norm, self.attn = nn.RMSNorm(h, c.norm_eps), PlainAttention(c, cross=False)
        if decoder:
            self.cross_norm, self.cross = nn.RMSNorm(h, c.norm_eps), PlainAttention(c, cross=True)
        self.decoder = decoder
        self.mlp_norm = nn.RMSNorm(h, c.norm_eps)
        self.mlp = nn.ModuleDict(
            {"wi": nn.Linear(h, 2 * f, bias=False), "wo": nn.Linear(f, h, bias=False)}
        )

    def forward(self, x, bias, memory=None, memory_mask=None):
        x = x + self.attn(self.attn_norm(x), bias)
        if self.decoder:
            x = x + self.cross(self.cross_norm(x), memory_mask, memory)
        gate, up = self.mlp["wi"](self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp["wo"](F.gelu(gate, approximate="tanh") * up)


class PlainT5(nn.Module):
    """T5 v1.1 for span corruption; parameter names are mtcore's, so its weights load."""

    def __init__(self, c: T5Config):
        super().__init__()
        self.c, h, e = c, c.hidden_size, c.encoder_layers
        self.embed = nn.Embedding(c.vocab_size, h)
        self.layers = nn.ModuleList(PlainLayer(c, i >= e) for i in range(c.num_layers))
        self.encoder_bias = nn.Embedding(c.relative_buckets, c.num_heads)
        self.decoder_bias = nn.Embedding(c.relative_buckets, c.num_heads)
        self.encoder_norm, self.decoder_norm = nn.RMSNorm(h, c.norm_eps), nn.RMSNorm(h, c.norm_eps)
        self.lm_head = nn.Linear(h, c.vocab_size, bias=False)

    def position_bias(self, table: nn.Embedding, length: int, bidirectional: bool):
        pos = torch.arange(length)
        buckets = relative_position_bucket(
            pos[None, :] - pos[:, None], bidirectional, self.c.relative_buckets,
            self.c.relative_max_distance,
        )  # fmt: skip
        return table(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, q, k]

    def forward(self, tokens, decoder_tokens, padding_mask):
        e, low = self.c.encoder_layers, torch.finfo(torch.float32).min
        key_mask = torch.zeros(padding_mask.shape).masked_fill(~padding_mask, low)[:, None, None]
        se, sd = tokens.shape[1], decoder_tokens.shape[1]
        enc_bias = self.position_bias(self.encoder_bias, se, True) + key_mask
        causal = torch.ones(sd, sd, dtype=torch.bool).tril()
        dec_bias = self.position_bias(self.decoder_bias, sd, False).masked_fill(~causal, low)
        x = self.embed(tokens)
        for layer in self.layers[:e]:
            x = layer(x, enc_bias)
        memory, y = self.encoder_norm(x), self.embed(decoder_tokens)
        for layer in self.layers[e:]:
            y = layer(y, dec_bias, memory, key_mask)
        return self.lm_head(self.decoder_norm(y))

    def loss(self, batch, count):
        """This micro-batch's share of the step's loss: its target tokens' summed
        cross-entropy over the step's target tokens (``count``)."""
        logits = self(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"])
        total = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # fmt: skip
        return total / count


class PlainLoop:
    def __init__(self, config: T5Config, weights: dict[str, torch.Tensor]):
        self.model = PlainT5(config)
        self.model.load_state_dict(weights, strict=True)
        self.opt = plain_adamw(self.model, OPT)

    def step(self, step: int, batches: list[dict]) -> float:
        count = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        losses = (self.model.loss(batch, count) for batch in batches)
        return plain_step(
            self.model, self.opt, OPT.lr_at(step, TOTAL_STEPS), OPT.max_grad_norm, losses
        )


class MtcoreLoop:
    def __init__(self, config: T5Config, backend, micro: int, microbatches: int):
        self.engine = one_process_engine(config, backend, micro, microbatches, OPT)

    def step(self, step: int, batches: list[dict]) -> float:
        self.engine.set_lr(OPT.lr_at(step, TOTAL_STEPS))
        return self.engine.train_step(batches).loss

    def loss(self, batch: dict) -> float:
        model = self.engine.chunks[0]
        ((total, count),) = model.loss(model.stage({}, batch), batch).values()
        return (total / count).item()


def one_add_attention(q, k, v, bias, causal, key_padding_mask):
    """An experiment, not mtcore's code: ``mtcore.models.t5.blocks.biased_attention``'s
    result for rows that have a key to attend, with the causal and padding masks folded
    into the bias as one additive ``-inf`` term (no masked_fill of the scores or the
    probabilities, no empty-row guard), as ``PlainT5`` does. ``--one-add-attention``
    times mtcore with it, to size what that change would save."""
    sq, sk = q.shape[2], k.shape[2]
    add = torch.zeros(1, 1, sq, sk, device=q.device)
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        add = add.masked_fill(~allowed, float("-inf"))
    if key_padding_mask is not None:
        add = add.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    if bias is not None:
        add = add + bias
    logits = torch.matmul(q, k.transpose(-1, -2)) + add
    return torch.matmul(torch.softmax(logits, dim=-1), v)


@contextlib.contextmanager
def _one_add_swapped():
    from mtcore.models.t5 import blocks

    original, blocks.biased_attention = blocks.biased_attention, one_add_attention
    try:
        yield
    finally:
        blocks.biased_attention = original


class OneAddLoop(MtcoreLoop):
    """``MtcoreLoop`` whose steps (and loss check) run T5 with ``one_add_attention``."""

    def step(self, step: int, batches: list[dict]) -> float:
        with _one_add_swapped():
            return super().step(step, batches)

    def loss(self, batch: dict) -> float:
        with _one_add_swapped():
            return super().loss(batch)


def make_batches(config: T5Config, steps: int, micro: int, microbatches: int, seed: int = 0):
    """``steps`` lists of ``microbatches`` span-corruption batches: pieces of random tokens
    of a random length in [raw/2, raw] (raw: what ``seq_len`` holds), corrupted by
    ``mtcore.models.t5.data`` (``SpanLoader``'s layout: padded input, decoder input shifted
    right after ``<pad>``, labels -100 on padding)."""
    se, sd, v = config.seq_len, config.decoder_seq_len, config.vocab_size
    raw = span_lengths(se, config.noise_density, config.mean_span_length, sd).raw_len
    sentinels = np.arange(v - SENTINELS, v)
    rng = np.random.default_rng(seed)

    def batch():
        arrays = dict(
            tokens=np.full((micro, se), PAD), padding_mask=np.zeros((micro, se), dtype=bool),
            decoder_tokens=np.full((micro, sd), PAD), labels=np.full((micro, sd), IGNORE_INDEX),
        )  # fmt: skip
        for row in range(micro):
            length = int(rng.integers(raw // 2, raw + 1))
            assert (
                lengths_of(length, config.noise_density, config.mean_span_length).decoder_len <= sd
            )
            piece = rng.integers(EOS + 1, v - SENTINELS, size=length)
            mask = noise_mask(length, config.noise_density, config.mean_span_length, rng)
            source, target = corrupt(piece, mask, sentinels, EOS)
            arrays["tokens"][row, : len(source)] = source
            arrays["padding_mask"][row, : len(source)] = True
            arrays["labels"][row, : len(target)] = target
            arrays["decoder_tokens"][row, 1 : len(target)] = target[:-1]
        return {k: torch.from_numpy(a) for k, a in arrays.items()}

    return [[batch() for _ in range(microbatches)] for _ in range(steps)]


def side_by_side(config: T5Config, args) -> None:
    micro, m = args.micro_batch, args.microbatches
    loops = {
        "mtcore": MtcoreLoop(config, select_backend("cpu"), micro, m),
        "mtcore+native": MtcoreLoop(config, native_backend(NATIVE_EXTRA), micro, m),
    }
    if args.one_add_attention:
        loops["mtcore one-add"] = OneAddLoop(config, select_backend("cpu"), micro, m)
    weights = {
        n: p.detach().clone() for n, p in loops["mtcore"].engine.chunks[0].named_parameters()
    }
    loops = {"plain torch": PlainLoop(config, weights), **loops}
    batches = make_batches(config, args.warmup + args.rounds * args.steps_per_round, micro, m)
    with torch.no_grad():  # the same loss from the same weights: the same math
        first = batches[0][0]
        count = (first["labels"] != IGNORE_INDEX).sum()
        losses = {"plain torch": loops["plain torch"].model.loss(first, count).item()}
        losses |= {n: loop.loss(first) for n, loop in loops.items() if n != "plain torch"}
    check_same_loss(losses, "plain torch", rtol=1e-5)

    def step(loop):
        return lambda i: loop.step(i + 1, batches[i])

    timings = alternate(
        {n: step(loop) for n, loop in loops.items()}, args.rounds, args.steps_per_round, args.warmup
    )
    targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for s in batches for b in s) / len(
        batches
    )
    print(
        f"\n{config.describe()}, fp32, {micro} x {m} sequences/step ({targets:.0f} target "
        f"tokens), {args.threads} thread(s), {args.rounds} rounds x {args.steps_per_round} "
        f"step(s) after {args.warmup} warm-up"
    )
    report(timings, "plain torch", micro * m * config.seq_len)
    if args.profile:
        profile_ops(loops, batches, args.profile)


def profile_ops(loops: dict, batches: list, steps: int, top: int = 8) -> None:
    """Where the time goes: each loop's ``steps`` steps under ``torch.profiler`` (the
    loops in turn, twice), the ``top`` ops by self CPU time (ms) of each pass."""
    from torch.profiler import ProfilerActivity, profile

    print(f"\nself CPU ms over {steps} steps (torch.profiler; each loop twice, in turn)")
    for rep in range(2):
        for name, loop in loops.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(steps):
                    loop.step(i + 1, batches[i % len(batches)])
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in events) / 1e3
            ops = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f}" for e in events[:top])
            print(f"{name} ({rep + 1}): total {total:.0f}; {ops}")


def _pipeline_rank(ctx, config: T5Config, micro: int, ms: list[int], reps: int) -> list[dict]:
    """Per m: each rep's (window, busy, [(action, seconds)]) of the runner's step. The
    m values take turns step by step (the order reversed every other step), so that
    background load falls on all of them alike; the first step of each is warm-up."""
    from mtcore.parallel.layout import LayoutSpec, ParallelLayout
    from mtcore.training.engine import Engine

    torch.set_num_threads(1)
    coll = ctx.backend.collective
    layout = ParallelLayout.build(LayoutSpec(pp=2), coll, ctx.rank, ctx.world_size)
    engines, records = {}, {m: [] for m in ms}
    for m in ms:
        engine = Engine(
            config, layout, ctx.backend, micro_batch_size=micro, num_microbatches=m,
            optimizer=OPT, seed=0,
        )  # fmt: skip
        engine.runner.trace = True
        engine.runner.step = _timed(engine.runner.step, coll, records[m])
        engines[m] = engine
    batches = {m: make_batches(config, 1 + reps, micro, m, seed=m) for m in ms}
    for rep in range(1 + reps):
        for m in ms if rep % 2 == 0 else ms[::-1]:
            engines[m].train_step(batches[m][rep])
    return [{"m": m, "reps": records[m][1:]} for m in ms]


def _timed(step, coll, records: list):
    """``step`` (a runner's) between two barriers, appending (window, busy, trace)."""

    def timed(*args):
        coll.barrier()
        t0 = time.perf_counter()
        stats = step(*args)
        coll.barrier()
        window = time.perf_counter() - t0
        records.append((window, stats.busy_s, [(a, end - s) for a, s, end in stats.trace]))
        return stats

    return timed


def _idle(schedule, cost) -> list[float]:
    from mtcore.parallel.pipeline import simulate

    timeline = simulate(schedule, cost=cost)
    return [timeline.idle_share(r) for r in range(schedule.pp)]


def pipeline(config: T5Config, args) -> None:
    from mtcore.parallel.pipeline import build_schedule

    start = time.perf_counter()
    ranks = run_ranks(
        _pipeline_rank, 2, config, args.micro_batch, args.m, args.reps, timeout_s=3600,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    counts = config.stage_counts(2)
    print(
        f"\npp=2 1F1B, {counts[0]} + {counts[1]} layers per stage (encoder {config.encoder_layers}, "
        f"decoder {config.decoder_layers}), micro-batch {args.micro_batch}, {args.reps} steps "
        f"after 1 warm-up ({time.perf_counter() - start:.0f} s)"
    )
    print("per stage (0 / 1); idle shares are medians over the steps")
    print(
        "| m | F ms | B ms | theory equal stages | theory this split | replay | measured | step s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for i, first in enumerate(ranks[0]):
        m = first["m"]
        schedule = build_schedule("1f1b", 2, m)
        reps = range(len(first["reps"]))

        def median_cost(r, kind, i=i):
            return statistics.median(
                d for rep in ranks[r][i]["reps"] for a, d in rep[2] if a.kind == kind
            )

        steady = {(r, k): median_cost(r, k) for r in range(2) for k in ("forward", "backward")}
        split = _idle(schedule, lambda r, a, steady=steady: steady[(r, a.kind)])
        measured_costs = [[dict(rep[2]) for rep in ranks[r][i]["reps"]] for r in range(2)]
        replays = [_idle(schedule, lambda r, a, k=k, c=measured_costs: c[r][k][a]) for k in reps]
        replay = [statistics.median(rep[r] for rep in replays) for r in range(2)]
        measured = [
            statistics.median(1 - busy / window for window, busy, _ in ranks[r][i]["reps"])
            for r in range(2)
        ]
        window = statistics.median(max(ranks[r][i]["reps"][k][0] for r in range(2)) for k in reps)

        def pair(values, fmt="{:.3f}"):
            return " / ".join(fmt.format(x) for x in values)

        print(
            f"| {m} | {pair([steady[(r, 'forward')] * 1e3 for r in range(2)], '{:.1f}')} | "
            f"{pair([steady[(r, 'backward')] * 1e3 for r in range(2)], '{:.1f}')} | "
            f"{1 / (m + 1):.3f} | {pair(split)} | {pair(replay)} | {pair(measured)} | {window:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128, help="encoder length (decoder: derived)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per step (one process)"
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each, first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches at pp=2")
    parser.add_argument("--reps", type=int, default=5, help="timed pp=2 steps per m")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile ops too")
    parser.add_argument(
        "--one-add-attention", action="store_true",
        help="also time mtcore with one_add_attention (an experiment)",
    )  # fmt: skip
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--skip-side-by-side", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few rounds: smoke test")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.heads, args.ffn, args.seq, args.vocab = 32, 2, 64, 32, 512
        args.micro_batch, args.rounds, args.warmup, args.m, args.reps = 2, 2, 1, [2], 2
    torch.set_num_threads(args.threads)
    print(f"load at start: {load_average()}")
    config = T5Config(
        vocab_size=args.vocab, hidden_size=args.hidden, encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers, num_heads=args.heads, ffn_hidden_size=args.ffn,
        seq_len=args.seq, dropout=0.0,
    )  # fmt: skip
    if not args.skip_side_by_side:
        side_by_side(config, args)
    if not args.skip_pipeline:
        pipeline(config, args)
        print(f"load at end: {load_average()}")


if __name__ == "__main__":
    main()
