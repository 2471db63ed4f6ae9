"""Document-masked attention on the CPU: which way the cpu backend should run it.

    .venv/bin/python benchmarks/bench_document_attention.py [--rounds 5] [--seq 512]

Three ways to attend the same packed tokens (``[batch, heads, seq, head_dim]``,
documents of random lengths), forward and backward, in one process, one thread,
alternating round by round:

- ``masked``: the cpu backend's ``sdpa`` kernel with the document ids, i.e. one SDPA
  call with a dense bool mask (what ``mtcore.ops.torch_native.sdpa_attention`` does);
- ``per-document``: one causal SDPA call per (row, document), outputs concatenated;
- ``causal``: plain causal SDPA on the same tokens, no document mask (the floor: what
  packing without document masks costs);
- ``cpu-backend``: what the ``cpu`` backend's attention kernel does
  (``host_sdpa_attention``: per-document from a mean document length of
  ``PER_DOCUMENT_MIN_MEAN_LENGTH`` tokens, else masked).

Printed: each way's median time per call and its per-round ratio to ``masked``
(paired medians), with ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mtcore.ops.torch_native import host_sdpa_attention, sdpa_attention


def packed_documents(batch: int, seq: int, mean_length: int, seed: int) -> torch.Tensor:
    """Document ids ``[batch, seq]``: lengths drawn uniformly in ``[1, 2 * mean_length]``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, 2 * mean_length + 1, (), generator=g)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    return torch.stack(rows)


def masked(q, k, v, documents):
    return sdpa_attention(q, k, v, True, query_documents=documents, key_documents=documents)


def per_document(q, k, v, documents):
    rows = []
    for row in range(q.shape[0]):
        ids = documents[row]
        bounds = torch.nonzero(ids[1:] != ids[:-1]).flatten().add(1).tolist()
        starts, ends = [0, *bounds], [*bounds, ids.numel()]
        pieces = [
            F.scaled_dot_product_attention(
                q[row : row + 1, :, a:b], k[row : row + 1, :, a:b], v[row : row + 1, :, a:b],
                is_causal=True,
            )
            for a, b in zip(starts, ends, strict=True)
        ]  # fmt: skip
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def causal(q, k, v, documents):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cpu_backend(q, k, v, documents):
    return host_sdpa_attention(q, k, v, True, query_documents=documents, key_documents=documents)


WAYS = {"masked": masked, "per-document": per_document, "causal": causal,
        "cpu-backend": cpu_backend}  # fmt: skip


def time_call(fn, q, k, v, documents, grad) -> float:
    start = time.perf_counter()
    out = fn(q, k, v, documents)
    torch.autograd.backward(out, grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="calls per way per round")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mean-length", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(time.strftime("%Y-%m-%d %H:%M:%S"), _uptime())
    print(f"q/k/v [{args.batch}, {args.heads}, {args.seq}, {args.head_dim}] {args.dtype}, "
          f"{args.rounds} rounds x {args.calls} calls, forward + backward, 1 thread")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    for mean in args.mean_length:
        documents = packed_documents(args.batch, args.seq, mean, seed=mean)
        q, k, v = (torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(*shape, generator=g).to(dtype)
        ref = masked(q, k, v, documents)
        alt = per_document(q, k, v, documents)
        error = (ref.float() - alt.float()).abs().max().item()
        times = {name: [] for name in WAYS}
        for fn in WAYS.values():  # warm-up
            time_call(fn, q, k, v, documents, grad)
        for _ in range(args.rounds):
            for name, fn in WAYS.items():
                calls = [time_call(fn, q, k, v, documents, grad) for _ in range(args.calls)]
                times[name].append(statistics.median(calls))
        docs = int((documents.max(dim=1).values + 1).sum())
        print(f"\nmean document length {mean}: {docs} documents in {args.batch} rows; "
              f"per-document vs masked max |diff| {error:.2e}")  # fmt: skip
        for name in WAYS:
            ratios = [t / m for t, m in zip(times[name], times["masked"], strict=True)]
            print(f"  {name:13s} {statistics.median(times[name]) * 1e3:8.2f} ms   "
                  f"x masked {statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip
    print("\n" + _uptime())


def _uptime() -> str:
    import os

    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"


if __name__ == "__main__":
    main()
