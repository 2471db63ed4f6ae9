"""Does Megatron-Core's T5 learn bench_megatron.py's T5 task, and from which tokens,
under each initialisation? One rank, no tp, torch AdamW, the benchmark's own shapes
and batches:

    .venv/bin/python benchmarks/bench_megatron_t5_init.py [--steps 30]

Per initialisation it trains ``--steps`` steps and evaluates the last batch as it is,
with every decoder token set to 0, and with every encoder token set to 0. A model
that reads the task off the decoder's own tokens (``next = perm[current]``) loses
most when those are zeroed.

* ``megatron``: Megatron's own (std 0.02 everywhere, embeddings too);
* ``word-std-1``: Megatron's, with the word embeddings redrawn at std 1;
* ``t5``: T5's, as the benchmark draws it (``build_t5``'s default).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from against_megatron import configs
from against_megatron.cpu_shims import megatron_on_cpu

INITS = ("megatron", "word-std-1", "t5")


def _build(init: str):
    from against_megatron.megatron_encoders import build_t5

    torch.manual_seed(0)
    model = build_t5(configs.BenchConfig(family="t5"), t5_init=init == "t5")
    if init == "word-std-1":
        with torch.no_grad():
            model.embedding.word_embeddings.weight.normal_(0.0, 1.0)
    return model


def _loss(model, batch: dict) -> torch.Tensor:
    from against_megatron.megatron_encoders import t5_forward

    return t5_forward(model, batch).float().mean()


def run(init: str, steps: int) -> dict:
    model = _build(init)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=configs.LR, betas=configs.BETAS, eps=configs.EPS, weight_decay=0.0
    )
    batches = configs.step_batches(configs.BenchConfig(family="t5"), steps, dp_rank=0)
    losses = []
    for micro_batches in batches:
        optimizer.zero_grad()
        total = 0.0
        for batch in micro_batches:
            loss = _loss(model, batch) / len(micro_batches)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    last = batches[-1][0]
    with torch.no_grad():
        zeroed = {
            name: _loss(model, {**last, name: torch.zeros_like(last[name])}).item()
            for name in ("decoder_tokens", "tokens")
        }
        return {
            "losses": losses,
            "eval": _loss(model, last).item(),
            "decoder tokens 0": zeroed["decoder_tokens"],
            "encoder tokens 0": zeroed["tokens"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--inits", nargs="+", choices=INITS, default=list(INITS))
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    megatron_on_cpu()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    print(f"load: {os.getloadavg()[0]:.2f}")
    print(
        f"| initialisation | loss after {args.steps} steps | decoder tokens 0 | encoder tokens 0 |"
    )
    print("|---|---|---|---|")
    for init in args.inits:
        res = run(init, args.steps)
        print(f"| {init} | {res['eval']:.2f} | {res['decoder tokens 0']:.2f} | "
              f"{res['encoder tokens 0']:.2f} |", flush=True)  # fmt: skip
        print("  curve: " + " ".join(f"{loss:.3f}" for loss in res["losses"]), file=sys.stderr)
    print(f"load: {os.getloadavg()[0]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
