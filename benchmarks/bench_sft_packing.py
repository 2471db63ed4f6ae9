"""Supervised fine-tuning: packed conversations with document masks against padding, on
the same data, one process, side by side.

    .venv/bin/python benchmarks/bench_sft_packing.py [--rounds 5 --steps-per-round 2]

The embedded chat set (``configs/sft.yaml``'s data and model) three ways:

- ``packed``: conversations packed into 256-token samples, attention kept inside each
  (document masks), positions restarting per conversation;
- ``padded-256``: one conversation per 256-token sample, padded;
- ``padded-longest``: one conversation per sample, padded to the set's longest
  conversation only (the shortest fixed length padding allows: mtcore's pipeline
  messages have shapes fixed before the step, so a length per micro-batch is not an
  option).

Each runs the trainer's ``Engine`` (fp32, 2 micro-batches of 8 samples a step) on its
own loader, in turn, round by round. Printed per way: median step time, trained tokens
(labels that are not -100) per second, all tokens per second, the paired per-round ratio
of trained tokens/s to ``packed``, and the load before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _loops import one_process_engine
from _timing import alternate, load_average

from mtcore.backend import select_backend
from mtcore.data import DataConfig
from mtcore.models.gpt import FAMILY, GPTConfig
from mtcore.training.config import OptimizerConfig

MODEL = dict(style="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
OPT = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=10, weight_decay=0.1, max_grad_norm=1.0)
MICRO, MICROBATCHES = 8, 2
DATA = dict(format="chat", vocab_size=1024, valid_fraction=0.05, seed=1234)


def ways() -> dict[str, tuple[DataConfig, int]]:
    longest = longest_conversation()
    return {
        "packed": (DataConfig(**DATA, seq_len=256, packing=True, reset_position_ids=True), 256),
        "padded-256": (DataConfig(**DATA, seq_len=256, packing=False), 256),
        "padded-longest": (DataConfig(**DATA, seq_len=longest, packing=False), longest),
    }


def longest_conversation() -> int:
    """The set's longest conversation in tokens, rounded up to a multiple of 8."""
    from mtcore.data.sft import build_chat_datasets

    # One conversation per sample, with its documents: document 0 is the conversation.
    padded = DataConfig(**DATA, seq_len=4096, packing=False, document_masks=True)
    train = build_chat_datasets(padded).train
    tokens = max(int((train[i]["documents"] == 0).sum()) for i in range(len(train)))
    return -(-tokens // 8) * 8


def make_step(data_config: DataConfig, seq_len: int, backend):
    config = GPTConfig(**MODEL, seq_len=seq_len)
    family_data = FAMILY.data(data_config, config)
    config = config.with_vocab(family_data.tokenizer.vocab_size)
    engine = one_process_engine(config, backend, MICRO, MICROBATCHES, OPT)
    loader = family_data.loader(family_data.train, micro_batch_size=MICRO,
                                global_batch_size=MICRO * MICROBATCHES, seed=data_config.seed)  # fmt: skip
    counts = {"trained": [], "tokens": []}

    def step(_index: int) -> float:
        batches = [next(loader) for _ in range(MICROBATCHES)]
        counts["trained"].append(sum(int((b["labels"] != -100).sum()) for b in batches))
        counts["tokens"].append(sum(b["tokens"].numel() for b in batches))
        return engine.train_step(batches).loss

    return step, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(time.strftime("%Y-%m-%d %H:%M:%S"), "start:", load_average())
    backend = select_backend("cpu")
    steps, counts, lengths = {}, {}, {}
    for name, (data_config, seq_len) in ways().items():
        steps[name], counts[name] = make_step(data_config, seq_len, backend)
        lengths[name] = seq_len
    timings = alternate(steps, args.rounds, args.steps_per_round, args.warmup)
    skip = args.warmup
    per_round = {}
    print(f"{'way':<15} {'seq':>4} {'median ms':>10} {'trained tok/s':>14} {'all tok/s':>10} "
          f"{'trained/step':>12} {'x packed':>9}")  # fmt: skip
    for name, rounds in timings.rounds.items():
        trained = counts[name]["trained"][skip:]
        tokens = counts[name]["tokens"][skip:]
        flat = timings.steps(name)
        per_round[name] = [
            sum(trained[r * args.steps_per_round : (r + 1) * args.steps_per_round]) / sum(times)
            for r, times in enumerate(rounds)
        ]
        median = statistics.median(flat)
        paired = statistics.median(
            mine / base for mine, base in zip(per_round[name], per_round.get("packed", per_round[name]),
                                              strict=True)
        )  # fmt: skip
        print(f"{name:<15} {lengths[name]:>4} {median * 1e3:>10.1f} "
              f"{sum(trained) / sum(flat):>14,.0f} {sum(tokens) / sum(flat):>10,.0f} "
              f"{statistics.mean(trained):>12.0f} {paired:>9.3f}")  # fmt: skip
    print("end:", load_average())


if __name__ == "__main__":
    main()
