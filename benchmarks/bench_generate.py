"""Greedy generation: mtcore's GPT with its KV cache against transformers' ``generate``,
on the same imported model, side by side in one process.

    .venv/bin/python benchmarks/bench_generate.py [--rounds 5 --new-tokens 96]
    .venv/bin/python benchmarks/bench_generate.py --quick      # smoke test, seconds

A random Llama (hidden 256, 4 layers, 8 heads and 4 key/value heads, vocabulary 2048,
``max_position_embeddings`` 256; fp32) is built and saved by transformers and imported
by mtcore (``mtcore.models.gpt.hf.import_hf``). Each configuration continues the same
prompt (batch 1, 16 tokens) by ``--new-tokens`` greedy tokens:

* ``transformers``: ``model.generate(do_sample=False)`` (its dynamic KV cache, SDPA);
* ``mtcore cached``: ``GPT.generate`` (per-layer K/V cache, the cpu backend's kernels);
* ``mtcore uncached``: ``GPT.generate(use_cache=False)``, the whole sequence per step
  (``--skip-uncached`` leaves it out).

The tokens must be equal before any timing. Then ``--rounds`` rounds, each
configuration once per round in turn (warm-up round untimed), so load from other
processes falls on all alike; the report gives median tokens/s, the ratio of medians
to transformers' and the median per-round ratio, and ``uptime``'s load at the start
and the end. One torch thread (``--threads``) unless asked otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import alternate, load_average

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, single_context
from mtcore.models.gpt.hf import import_hf

PROMPT = 16


def _models(quick: bool):
    import transformers

    sizes = dict(
        vocab_size=512 if quick else 2048,
        hidden_size=64 if quick else 256,
        intermediate_size=128 if quick else 688,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        config, weights = import_hf(directory)
    mine = GPT(config, single_context(config, select_backend("cpu"))).eval()
    mine.load_state_dict(weights)
    return hf, mine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-uncached", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.new_tokens = 2, 16
    torch.set_num_threads(args.threads)
    print(f"load at start: {load_average()}")
    hf, mine = _models(args.quick)
    prompt = torch.randint(
        0, hf.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1)
    )
    n = args.new_tokens

    def run_hf() -> torch.Tensor:
        return hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip

    runs = {
        "transformers": run_hf,
        "mtcore cached": lambda: mine.generate(prompt, n),
    }
    if not args.skip_uncached:
        runs["mtcore uncached"] = lambda: mine.generate(prompt, n, use_cache=False)
    with torch.no_grad():
        outputs = {name: run() for name, run in runs.items()}
        want = outputs["transformers"]
        for name, got in outputs.items():
            if not torch.equal(got, want):
                print(f"{name}: tokens differ from transformers'", file=sys.stderr)
                return 1
        print(f"tokens equal ({n} new after a {PROMPT}-token prompt, greedy)")
        timings = alternate({k: (lambda i, run=v: float(run().shape[1])) for k, v in runs.items()},
                            rounds=args.rounds, warmup=1)  # fmt: skip
    base = timings.rounds["transformers"]
    base_median = statistics.median(timings.steps("transformers"))
    print(
        f"{'configuration':<17} {'median s':>9} {'tokens/s':>9} {'speed vs hf':>12} {'paired':>7}"
    )
    for name, rounds in timings.rounds.items():
        med = statistics.median(timings.steps(name))
        paired = statistics.median(b[0] / a[0] for a, b in zip(rounds, base, strict=True))
        print(f"{name:<17} {med:>9.3f} {n / med:>9.1f} {base_median / med:>12.3f} {paired:>7.3f}")
    print(f"load at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
