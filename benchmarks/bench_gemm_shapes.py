"""The matrix products of Megatron-Core's published H100 rows, timed one by one.

    python3 benchmarks/bench_gemm_shapes.py [--json FILE] [--reps 20]
    .venv/bin/python benchmarks/bench_gemm_shapes.py --cpu      # a self-check, no timing worth reading

``mtcore plan`` credits every large product one share of the accelerator's peak: 0.81
fitted on A100, scaled by the accelerator's published best-shape matmul share (0.748
of peak for H100). Three of Megatron-Core's five H100 rows (1.7B, 7.1B, 16B) come out
17-29% faster than published, and Megatron-LM's README puts its small rows' lower MFU
down to smaller products being less efficient. No per-shape table for H100 is
published; this measures one.

For each row (seq 4096, vocabulary 131,072, the tests' micro-batch: the whole per-rank
batch at pp = 1, one sequence at pp > 1; tp as published, sequence parallel), one
layer's products and the output layer's are timed in bf16: the query/key/value and
output projections, both MLP products and the logits, each as the forward, the input
gradient and the weight gradient (``[T, K] @ [K, N]``, ``[T, N] @ [N, K]``,
``[K, T] @ [T, N]``). Printed: each product's TFLOP/s, and per row the TFLOP/s of a
step's products (every layer's, the logits once) and its share of the dense bf16 peak,
beside the share the planner credits.
An H200 has H100's compute (the same GH100 SMs and clocks, 989 TFLOP/s dense bf16),
so its shares stand for H100's products; only its memory differs.

Without an accelerator, or with ``--cpu``, every dimension is divided by ``--cpu-scale``
(32) and the products run in float32 on the CPU: that checks the script (it runs in
the default test run), and its numbers mean nothing.

``--toml FILE`` writes what was measured as a hardware file's GEMM-shape table
(``[gemm_efficiency.DTYPE]``, ``"MxKxN" = fraction of peak``, the three passes of each
product together: docs/plan.md), to paste into the accelerator's description.

``--planner CONFIG --layouts A B ... --nproc N`` times instead the products ``mtcore
plan`` costs for those layouts of a training config (each block's, the attention's per
head, the output layer's), at full size, in the config's dtype, on ``--threads`` threads
(1: as ``mtcore sweep`` runs its ranks), as fractions of the ``--hardware`` file's peak;
this is how ``cpu-host``'s table was measured::

    .venv/bin/python benchmarks/bench_gemm_shapes.py --planner configs/default.yaml \
        --layouts tp=2,pp=2 tp=2,pp=1 tp=1,pp=2,vpp=2 --nproc 4 --toml cpu-host-gemm.toml
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SEQ, VOCAB = 4096, 131072
# name, hidden, layers, tp, micro-batch (sequences): Megatron-Core's H100 rows (dp 48),
# with the micro-batch tests/unit/plan/test_published_rows.py assumes
ROWS = [
    ("1.7B", 2048, 24, 1, 4),
    ("7.1B", 4096, 30, 2, 4),
    ("16B", 6144, 32, 4, 4),
    ("70B", 8192, 84, 8, 1),
    ("177B", 12288, 96, 8, 1),
]
PASSES = ("forward", "input grad", "weight grad")


def products(hidden: int, tp: int, tokens: int, scale: int = 1) -> list[tuple[str, int, int, int]]:
    """``(name, T, K, N)`` of one layer's column/row-parallel products and the output
    layer on one tp rank (sequence parallel: the products see all ``T`` tokens)."""
    h, t = hidden // scale, tokens // scale
    return [
        ("qkv", t, h, 3 * h // tp),
        ("proj", t, h // tp, h),
        ("fc1", t, h, 4 * h // tp),
        ("fc2", t, 4 * h // tp, h),
        ("logits", t, h, VOCAB // scale // tp),
    ]


def _operands(pass_: str, t: int, k: int, n: int, dtype, device):
    shape = {"forward": ((t, k), (k, n)), "input grad": ((t, n), (n, k)),
             "weight grad": ((k, t), (t, n))}[pass_]  # fmt: skip
    return [torch.randn(*s, dtype=dtype, device=device) for s in shape]


def time_product(a, b, reps: int, synchronize) -> float:
    """Median seconds of ``a @ b`` over ``reps`` timed calls after three untimed ones."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device(cpu: bool):
    accelerator = None if cpu else torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu"), torch.float32, lambda: None
    device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    return device, torch.bfloat16, torch.accelerator.synchronize


def planner_share() -> float | None:
    """The share of H100's peak the planner credits large products (None: not importable)."""
    try:
        from mtcore.plan import load_hardware, timing
    except ImportError:
        return None
    hardware = load_hardware("H100-SXM")
    peak = hardware.peak_flops("bf16")
    return timing.gemm_flops(hardware, peak) / peak


def time_passes(t: int, k: int, n: int, dtype, device, reps: int, synchronize) -> float:
    """Seconds of a product's forward, input-gradient and weight-gradient passes."""
    spent = 0.0
    for pass_ in PASSES:
        a, b = _operands(pass_, t, k, n, dtype, device)
        spent += time_product(a, b, reps, synchronize)
        del a, b
    return spent


def toml_table(dtype: str, fractions: dict[tuple[int, int, int], float]) -> str:
    """A hardware file's ``[gemm_efficiency.DTYPE]`` table (``mtcore.plan.gemm``)."""
    lines = [f"[gemm_efficiency.{dtype}]"]
    for (m, k, n), fraction in sorted(fractions.items(), key=lambda item: item[0]):
        lines.append(f'"{m}x{k}x{n}" = {min(1.0, fraction):.3f}')
    return "\n".join(lines) + "\n"


def planner_shapes(config_path: str, layouts: list[str], nproc: int) -> tuple[str, set]:
    """(the config's dtype, every product shape ``mtcore plan`` costs for ``layouts``)."""
    from mtcore.plan import model_shape
    from mtcore.plan.layouts import layout_overrides
    from mtcore.plan.planner import with_data_vocab
    from mtcore.plan.stage import score_products, weight_products
    from mtcore.training.overrides import load_config

    shapes, dtype = set(), "fp32"
    for layout in layouts:
        config = with_data_vocab(load_config(config_path, layout_overrides(layout)))
        spec, _ = config.check(nproc)
        dtype, b = config.precision.dtype, config.training.micro_batch_size
        shape = model_shape(config.model)
        found = [((b * shape.head_seq / spec.cp, shape.hidden, shape.vocab / spec.tp), 1)]
        for block in set(shape.blocks):
            found += weight_products(block, b * block.seq / spec.cp, spec.tp, spec.ep)
            found += score_products(block, b, spec.tp, spec.cp)
        shapes |= {tuple(round(d) for d in dims) for dims, _ in found}
    return dtype, shapes


def planner_main(args) -> None:
    from mtcore.plan import load_hardware

    torch.set_num_threads(args.threads)
    dtype_name, shapes = planner_shapes(args.planner, args.layouts, args.nproc)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device, _, synchronize = _device(cpu=True)
    peak = load_hardware(args.hardware).peak_flops(dtype_name)
    print(f"{len(shapes)} products of {args.planner} ({', '.join(args.layouts)}), {dtype_name}, "
          f"{args.threads} thread(s), median of {args.reps} calls; peak {peak / 1e12:g} TFLOP/s")  # fmt: skip
    fractions = {}
    for t, k, n in sorted(shapes):
        spent = time_passes(t, k, n, dtype, device, args.reps, synchronize)
        fractions[(t, k, n)] = 3 * 2.0 * t * k * n / spent / peak
        print(f"  {t}x{k}x{n}: {fractions[(t, k, n)]:.3f} of peak")
    _write_toml(args.toml, dtype_name, fractions)


def _write_toml(path: str | None, dtype: str, fractions: dict) -> None:
    if path:
        with open(path, "w") as file:
            file.write(toml_table(dtype, fractions))
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="a scaled-down self-check on the CPU")
    parser.add_argument("--cpu-scale", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak the shares are of (H100/H200 SXM: 989)")  # fmt: skip
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--toml", help="write the measured shapes as a GEMM-shape table")
    parser.add_argument("--planner", metavar="CONFIG", help="time the plan's products of CONFIG")
    parser.add_argument("--layouts", nargs="+", default=["tp=1"], help="--planner: layouts")
    parser.add_argument("--nproc", type=int, default=4, help="--planner: ranks of the job")
    parser.add_argument("--hardware", default="cpu-host", help="--planner: whose peak")
    parser.add_argument("--threads", type=int, default=1, help="--planner: torch threads")
    args = parser.parse_args()
    if args.planner:
        planner_main(args)
        return
    device, dtype, synchronize = _device(args.cpu)
    scale = 1 if device.type != "cpu" else args.cpu_scale
    reps = args.reps if device.type != "cpu" else 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else device.type
    print(f"device {name}, {dtype}, dimensions / {scale}, median of {reps} calls")
    credited = planner_share()
    results, fractions = [], {}
    for row, hidden, layers, tp, micro_batch in ROWS:
        flops = seconds = 0.0  # a step's worth: every layer's products, the logits once
        for product, t, k, n in products(hidden, tp, micro_batch * SEQ, scale):
            times = 1 if product == "logits" else layers
            shape_seconds = 0.0
            for pass_ in PASSES:
                a, b = _operands(pass_, t, k, n, dtype, device)
                spent = time_product(a, b, reps, synchronize)
                work = 2.0 * t * k * n
                flops, seconds = flops + times * work, seconds + times * spent
                shape_seconds += spent
                results.append({"row": row, "product": product, "pass": pass_,
                                "a": list(a.shape), "b": list(b.shape),
                                "tflops": work / spent / 1e12})  # fmt: skip
                print(f"  {row:>5} {product:<7} {pass_:<12} {list(a.shape)}@{list(b.shape)} "
                      f"{work / spent / 1e12:8.1f} TFLOP/s")  # fmt: skip
                del a, b
            fractions[(t, k, n)] = 3 * 2.0 * t * k * n / shape_seconds / (args.peak_tflops * 1e12)
        achieved = flops / seconds / 1e12
        share = achieved / args.peak_tflops
        results.append({"row": row, "product": "all", "tflops": achieved, "share": share})
        print(
            f"{row}: {achieved:.1f} TFLOP/s over its products, {share:.3f} of "
            f"{args.peak_tflops:g}" + (f" (the planner credits {credited:.3f})" if credited else "")
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {"device": name, "dtype": str(dtype), "scale": scale, "results": results},
                file,
                indent=1,
            )
    _write_toml(args.toml, "bf16" if dtype == torch.bfloat16 else "fp32", fractions)


if __name__ == "__main__":
    main()
