"""What the B/W split costs: one backward against B (input gradients) + W (the
deferred weight-gradient products and their accumulation, ``hand_over``), in one
process, as the pipeline runner runs them.

    .venv/bin/python benchmarks/bench_weight_grad_split.py [--reps 30] [--hidden 512]

Two MLP blocks (hidden -> 4 hidden -> hidden, mtcore's tp=1 linears) as in
bench_pipeline.py, one thread; the unsplit and split backward alternate step by step,
so both see the same background load. Prints the median milliseconds of each part.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from mtcore.backend import select_backend
from mtcore.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPGroup
from mtcore.parallel.tensor.weight_grad import WeightGradStore, deferring_weight_grads, hand_over


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, tp: TPGroup, generator: torch.Generator):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, 4 * hidden, tp, generator=generator)
        self.down = RowParallelLinear(4 * hidden, hidden, tp, generator=generator)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def unsplit(model, x, grad) -> dict[str, float]:
    out = model(x)
    start = time.perf_counter()
    torch.autograd.backward([out], [grad])
    return {"backward": time.perf_counter() - start}


def split(model, x, grad) -> dict[str, float]:
    params, store = list(model.parameters()), WeightGradStore()
    with deferring_weight_grads(store):
        out = model(x)
    start = time.perf_counter()
    found = torch.autograd.grad([out], [x, *params], [grad], allow_unused=True)
    b_done = time.perf_counter()
    own = [(p, g) for p, g in zip(params, found[1:], strict=True) if g is not None]
    del found

    def grads() -> list[torch.Tensor]:
        out = [g for _, g in own] + [g for _, g in store.compute()]
        own.clear()
        return out

    hand_over([p for p, _ in own] + store.weights(), grads)
    return {"B": b_done - start, "W": time.perf_counter() - b_done}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, nargs=2, default=(2, 64), metavar=("B", "S"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tp = TPGroup.single(select_backend("cpu"))
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(MLPBlock(args.hidden, tp, generator) for _ in range(2)))
    x = torch.randn(*args.tokens, args.hidden, requires_grad=True)
    grad = torch.randn(*args.tokens, args.hidden)
    times: dict[str, list[float]] = {}
    for rep in range(args.reps + 1):
        order = (unsplit, split) if rep % 2 == 0 else (split, unsplit)
        for run in order:
            for p in model.parameters():
                p.grad = None
            for part, seconds in run(model, x, grad).items():
                if rep > 0:  # the first round warms up
                    times.setdefault(part, []).append(seconds)
    medians = {part: statistics.median(s) * 1e3 for part, s in times.items()}
    for part, ms in medians.items():
        print(f"{part:>14}: {ms:7.2f} ms")
    total = sum(ms for part, ms in medians.items() if part != "backward")
    print(f"{'B + W':>14}: {total:7.2f} ms ({total / medians['backward']:.2f} of the backward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
