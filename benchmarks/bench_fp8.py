"""A GPT training step in bf16 against FP8 (each recipe), one process.

    .venv/bin/python benchmarks/bench_fp8.py [--steps 20 --warmup 3 --hidden 2048 ...]

Four configurations train the same Llama-style GPT from the same weights on the
same batches with the trainer's ``Engine`` (bf16 params, fp32 master weights):
``bf16``, and FP8 block linears under ``hybrid`` E4M3/E5M2 with ``delayed``,
``current`` and ``blockwise`` scaling (``mtcore.precision.fp8``). The embedding,
attention core and output layer stay bf16. They alternate step by step, so load
from other processes hits them alike; reported are each one's loss at the end
and its difference from bf16, and on an accelerator the median step time and
its ratio to bf16.

On the CPU backend the FP8 GEMMs are torch._scaled_mm's reference CPU path
(per-tensor) or the dequantize fallback (blockwise) and the quantization is the
reference op: the run checks correctness and plumbing only, and prints no
speed figures. ``mtcore doctor`` says which GEMMs are native on a backend.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.precision.fp8 import FP8Recipe
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

OPT = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0)
CONFIGS = {
    "bf16": None,
    "fp8 delayed": FP8Recipe("hybrid", "delayed"),
    "fp8 current": FP8Recipe("hybrid", "current"),
    "fp8 blockwise": FP8Recipe("hybrid", "blockwise"),
}


def batches(vocab: int, steps: int, micro: int, microbatches: int, seq: int, device):
    """Learnable synthetic sequences: token i of a row is (a * i + b) mod vocab."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        rows = micro * microbatches
        a = torch.randint(1, 17, (rows, 1), generator=g)
        b = torch.randint(0, vocab, (rows, 1), generator=g)
        tokens = (a * torch.arange(seq + 1) + b) % vocab
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        out.append((list(x.split(micro)), list(y.split(micro))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (GPU), 128 (CPU)")
    parser.add_argument("--layers", type=int, default=None, help="default 4 (GPU), 2 (CPU)")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (GPU), 128 (CPU)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--backend", default=None, help="default: the best available")
    args = parser.parse_args()

    backend = select_backend(args.backend)
    on_cpu = backend.device.type == "cpu"
    if on_cpu:
        torch.set_num_threads(args.threads)
    hidden = args.hidden or (128 if on_cpu else 2048)
    layers = args.layers or (2 if on_cpu else 4)
    seq = args.seq or (128 if on_cpu else 1024)
    model = GPTConfig(
        vocab_size=8192 if not on_cpu else 1024,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 128 if hidden >= 512 else 4,
        num_kv_heads=None,
        seq_len=seq,
    )
    label = "CPU: correctness/plumbing only" if on_cpu else backend.device.type
    print(
        f"backend {backend.name} ({label}); model hidden {hidden}, {layers} layers, seq {seq}, "
        f"{args.microbatches} x {args.micro} sequences per step, {args.steps} steps"
    )
    print(
        "fp8 GEMM paths: "
        + ", ".join(
            f"{r.scaling} {'/'.join(sorted(set(r.paths(backend.fp8).values())))}"
            for r in CONFIGS.values()
            if r is not None
        )
    )

    data = batches(
        model.vocab_size, args.steps, args.micro, args.microbatches, seq, backend.torch_device()
    )
    engines = {
        name: Engine(
            model,
            ParallelLayout.single(),
            backend,
            micro_batch_size=args.micro,
            num_microbatches=args.microbatches,
            optimizer=OPT,
            precision=MixedPrecision("bf16", fp8=recipe),
            seed=1,
        )
        for name, recipe in CONFIGS.items()
    }
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    for step, (x, y) in enumerate(data):
        for name, engine in engines.items():
            engine.set_lr(OPT.lr_at(step + 1, args.steps))
            backend.device.synchronize()
            t0 = time.perf_counter()
            out = engine.train_step(x, y)
            backend.device.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(out.loss)

    ref = losses["bf16"][-1]
    base = statistics.median(times["bf16"]) if times["bf16"] else None
    print(
        f"{'config':<14} {'first loss':>10} {'last loss':>10} {'vs bf16':>8}"
        + ("" if on_cpu else f" {'step ms':>9} {'speedup':>7}")
    )
    for name in engines:
        last = losses[name][-1]
        line = f"{name:<14} {losses[name][0]:>10.4f} {last:>10.4f} {(last - ref) / ref:>+8.2%}"
        if not on_cpu and times[name]:
            med = statistics.median(times[name])
            line += f" {med * 1e3:>9.1f} {base / med:>6.2f}x"
        print(line)
    if on_cpu:
        print("CPU: correctness/plumbing only; step times are not FP8 speed (no FP8 hardware).")


if __name__ == "__main__":
    main()
