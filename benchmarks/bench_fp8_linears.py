"""One rank's FP8 linears of the default job, CPU time per step, bf16 against each recipe.

    .venv/bin/python benchmarks/bench_fp8_linears.py [--rounds 5 --steps 3]

The four linears of a block on one rank of configs/default.yaml (tp=2: x ``[512, K]``
bf16 with K of 128, 64, 128 and 352, output N of 160, 128, 704 and 128), forward and
backward for 4 micro-batches per step, with per-step FP8 bookkeeping as the trainer
runs it (the FP8 weight made once per step). Only the linears: no attention, norms,
optimizer or communication, so the FP8 overhead shows undiluted. Configurations
alternate round by round; each one's CPU time (``time.process_time``) per step is
the least over the rounds, which load from other processes raises least. ``uptime``
before and after.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

from mtcore.backend import select_backend
from mtcore.precision.fp8.linear import fp8_linear
from mtcore.precision.fp8.recipes import FP8Recipe
from mtcore.precision.fp8.state import FP8Scaling

SHAPES = [(128, 160), (64, 128), (128, 704), (352, 128)]  # (K, N) per rank
TOKENS, MICRO_BATCHES = 512, 4  # micro-batch 4 x seq 128


def linears(recipe: str | None, fp8) -> list[tuple]:
    torch.manual_seed(0)
    out = []
    for k, n in SHAPES:
        x = torch.randn(TOKENS, k, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(TOKENS, n, dtype=torch.bfloat16) * 1e-3
        scaling = None
        if recipe is not None:
            scaling = FP8Scaling(FP8Recipe("hybrid", recipe), fp8)
            scaling.per_step = True  # as FP8StepBookkeeping sets it for the trainer
        out.append((x, w, dy, scaling))
    return out


def step(layers: list[tuple]) -> None:
    for *_, scaling in layers:
        if scaling is not None:
            scaling.new_step()
    for _ in range(MICRO_BATCHES):
        for x, w, dy, scaling in layers:
            y = F.linear(x, w) if scaling is None else fp8_linear(x, w, None, scaling)
            y.backward(dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration and round")
    args = parser.parse_args()
    fp8 = select_backend("cpu").fp8
    configs = {"bf16": linears(None, fp8)}
    configs.update({f"fp8-{r}": linears(r, fp8) for r in ("delayed", "current", "blockwise")})
    print(f"load at start: {load_average()}")
    for layers in configs.values():
        step(layers)  # warm-up: first calls, scratch buffers
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(args.rounds):
        for name, layers in configs.items():
            start = time.process_time()
            for _ in range(args.steps):
                step(layers)
            best[name] = min(best[name], (time.process_time() - start) / args.steps)
    print(f"load at end: {load_average()}")
    print("\n| linears | CPU ms/step (least of rounds) | FP8 overhead ms | ratio to bf16 |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        extra = (seconds - best["bf16"]) * 1e3
        print(f"| {name} | {seconds * 1e3:.1f} | {extra:.1f} | {seconds / best['bf16']:.2f} |")


if __name__ == "__main__":
    main()
