"""The Triton kernel pack (mtcore-triton) against torch eager (the reference ops).

    .venv/bin/python benchmarks/bench_kernels.py [--dtype bfloat16] [--cpu]

On an NVIDIA GPU: for each op, the reference op of ``mtcore.ops`` (torch eager,
the spec) and the Triton kernel run on the same inputs; reported are the median
times from ``triton.testing.do_bench`` (forward, and forward+backward for the
differentiable ops), the ratio eager / Triton (above 1: Triton is faster), and
the largest error of the Triton result against the reference.

Without a GPU (or with ``--cpu``) it reports CORRECTNESS ONLY: every kernel runs
on small CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are imported) and the largest errors against the reference
are printed. Interpreter timings mean nothing and are not shown.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (op, shapes) for a GPU: Llama-7B-like layers on 8192 tokens; small ones for the interpreter.
GPU_SHAPES = {
    "rms_norm": (8192, 4096),
    "layer_norm": (8192, 4096),
    "rope": (4, 2048, 32, 128),
    "swiglu": (8192, 2 * 11008),
    "cross_entropy": (8192, 32000),
    "adamw_step": (64, 1 << 20),  # 64 tensors of 1M elements
    "fp8": (8192, 8192),
}
CPU_SHAPES = {
    "rms_norm": (37, 300),
    "layer_norm": (37, 300),
    "rope": (2, 9, 3, 40),
    "swiglu": (5, 2 * 700),
    "cross_entropy": (6, 2500),
    "adamw_step": (3, 1000),
    "fp8": (130, 257),
}


def _inputs(op, shape, dtype, device):
    from mtcore.ops import rope_tables

    g = torch.Generator().manual_seed(0)

    def randn(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    if op in ("rms_norm", "layer_norm"):
        n = shape[-1]
        args = [randn(*shape), randn(n) + 1]
        return args + ([randn(n)] if op == "layer_norm" else []) + [1e-5]
    if op == "rope":
        cos, sin = rope_tables(shape[1], shape[3], device=device)
        return [randn(*shape), cos, sin]
    if op == "swiglu":
        return [randn(*shape)]
    if op == "cross_entropy":
        target = torch.randint(0, shape[1], (shape[0],), generator=g).to(device)
        target[::7] = -100
        return [randn(*shape, scale=3.0), target]
    raise KeyError(op)


def _max_err(got, want) -> float:
    return (got.detach().double() - want.detach().double()).abs().max().item()


# Which arguments get gradients (rope's tables do not: the pack differentiates x only).
DIFFERENTIABLE = {
    "rms_norm": (0, 1),
    "layer_norm": (0, 1, 2),
    "rope": (0,),
    "swiglu": (0,),
    "cross_entropy": (0,),
}


def _fwd_bwd(op, fn, args):
    leaves = [
        a.detach().clone().requires_grad_() if i in DIFFERENTIABLE[op] else a
        for i, a in enumerate(args)
    ]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return out, [leaves[i].grad for i in DIFFERENTIABLE[op]]


def _fp8_ok(device) -> bool:
    # Triton's float8e4nv needs capability 8.9 (the pack's registration gates on it too).
    return device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def correctness(pack, ref, shapes, dtype, device) -> list[tuple[str, float, float | None]]:
    """(op, max forward error, max gradient error) of each Triton kernel vs the reference."""
    rows = []
    for op in ("rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy"):
        args = _inputs(op, shapes[op], dtype, device)
        # Reference on the same rounded inputs, computed in float32 inside and rounded once.
        out, grads = _fwd_bwd(op, getattr(pack, op), args)
        want, want_grads = _fwd_bwd(op, getattr(ref, op), args)
        rows.append(
            (
                op,
                _max_err(out, want),
                max(_max_err(a, b) for a, b in zip(grads, want_grads, strict=True)),
            )
        )
    n, size = shapes["adamw_step"]
    lists = _adamw_lists(n, size, dtype, device)
    copies = [[t.clone() for t in lst] for lst in lists]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    pack.adamw_step(*lists, step=3, **hyper)
    ref.adamw_step(*copies, step=3, **hyper)
    rows.append(
        (
            "adamw_step",
            max(_max_err(a, b) for a, b in zip(lists[0], copies[0], strict=True)),
            None,
        )
    )
    x = _inputs("rms_norm", shapes["fp8"], dtype, device)[0]
    for gran in ("tensor", "1x128", "128x128") if _fp8_ok(device) else ():
        mine, mine_t = pack.fp8_quantize_transpose(x, torch.float8_e4m3fn, gran)
        want, want_t = ref.fp8_quantize_transpose(x, torch.float8_e4m3fn, gran)
        err = max(
            _max_err(mine[0].float(), want[0].float()),
            _max_err(mine_t[0].float(), want_t[0].float()),
        )
        rows.append((f"fp8_quantize_transpose {gran}", err, None))
    return rows


def _adamw_lists(n, size, dtype, device):
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(size, generator=g).to(device=device, dtype=dtype) for _ in range(n)]
    grads = [torch.randn(size, generator=g).to(device=device, dtype=dtype) for _ in range(n)]
    zeros = [[torch.zeros(size, device=device) for _ in range(n)] for _ in range(2)]
    return [params, grads, *zeros]


def timings(pack, ref, dtype, device):
    from triton.testing import do_bench

    print(f"{'op':<34} {'eager ms':>9} {'triton ms':>9} {'eager/triton':>12}")

    def row(label, eager, fused):
        e, t = do_bench(eager), do_bench(fused)
        print(f"{label:<34} {e:>9.3f} {t:>9.3f} {e / t:>12.2f}")

    for op in ("rms_norm", "layer_norm", "rope", "swiglu", "cross_entropy"):
        args = _inputs(op, GPU_SHAPES[op], dtype, device)
        shape = "x".join(map(str, GPU_SHAPES[op]))
        row(
            f"{op} fwd {shape}",
            lambda op=op, a=args: getattr(ref, op)(*a),
            lambda op=op, a=args: getattr(pack, op)(*a),
        )
        row(
            f"{op} fwd+bwd",
            lambda op=op, a=args: _fwd_bwd(op, getattr(ref, op), a),
            lambda op=op, a=args: _fwd_bwd(op, getattr(pack, op), a),
        )
    n, size = GPU_SHAPES["adamw_step"]
    lists = _adamw_lists(n, size, dtype, device)
    hyper = {"step": 2, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    row(
        f"adamw_step {n}x{size}",
        lambda: ref.adamw_step(*lists, **hyper),
        lambda: pack.adamw_step(*lists, **hyper),
    )
    x = _inputs("rms_norm", GPU_SHAPES["fp8"], dtype, device)[0]
    for gran in ("tensor", "row", "1x128", "128x128") if _fp8_ok(device) else ():
        for name in ("fp8_quantize", "fp8_quantize_transpose"):
            row(
                f"{name} {gran}",
                lambda name=name, g=gran: getattr(ref, name)(x, torch.float8_e4m3fn, g),
                lambda name=name, g=gran: getattr(pack, name)(x, torch.float8_e4m3fn, g),
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--cpu", action="store_true", help="correctness under the interpreter only")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        # triton.jit reads this when the kernels are decorated, i.e. on import below.
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from mtcore_triton import registration as pack
    except ImportError as exc:
        sys.exit(f"the kernel pack needs mtcore-triton (plugins/mtcore_triton): {exc}")
    from mtcore import ops as ref

    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        print(
            f"GPU: {torch.cuda.get_device_name()}, dtype {args.dtype}; torch eager = mtcore.ops reference"
        )
        timings(pack, ref, dtype, device)
        shapes = GPU_SHAPES
    else:
        print(f"CPU, Triton interpreter, dtype {args.dtype}: CORRECTNESS ONLY (no GPU; no timings)")
        shapes = CPU_SHAPES
    print(f"\n{'op (max |triton - reference|)':<34} {'forward':>10} {'gradients':>10}")
    for op, fwd, bwd in correctness(pack, ref, shapes, dtype, device):
        print(f"{op:<34} {fwd:>10.3g} {'-' if bwd is None else format(bwd, '.3g'):>10}")


if __name__ == "__main__":
    main()
