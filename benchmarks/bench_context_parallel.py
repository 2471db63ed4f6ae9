"""Context parallelism on gloo: activation memory per rank, bytes on the wire, step time.

    .venv/bin/python benchmarks/bench_context_parallel.py [--seqs 2048 4096 8192] [--rounds 4]
    .venv/bin/python benchmarks/bench_context_parallel.py --quick   # smoke test, tiny sizes

The model is configs/default.yaml's (Llama style, hidden 128, 4 layers, 4 query and
2 key/value heads, vocabulary 4096), fp32, at the sequence lengths asked for.

1. **Memory** (cp = 1, 2, 4; one spawn per cp): the bytes of the activations one
   forward of one sequence (the model and its loss) saves for backward on each rank,
   summed over the distinct storages that ``torch.autograd.graph.saved_tensors_hooks``
   sees, parameters left out. Deterministic. Target: cp=1's / cp, within 15%.
2. **Bytes on the wire** (same spawns): one training step (``Engine.train_step``) on
   one sequence with the backend's ``Collective`` wrapped by ``WireCounter``, which
   counts what each rank sends per call: a send's bytes, and for a collective over
   ``n`` ranks the least a ring algorithm sends: all-gather ``(n-1) x`` the input,
   reduce-scatter and all-to-all ``(n-1)/n x`` the input, all-reduce ``2 (n-1)/n x``.
   Split by group: ``cp`` (attention) and ``dp_cp`` (gradients and loss counts).
   The attention bytes are checked against the closed forms in ``expected_cp_bytes``.
3. **Step time** (2 ranks, one thread each): cp=1 (rank 0 alone; rank 1 waits in a
   barrier), dp=2 (one sequence per rank) and cp=2 for each method, on the same two
   sequences per step; each step is timed between two barriers, the configurations
   take turns round by round (the order reversed every other round). ``uptime`` is
   printed before and after. The ratio that isolates cp's cost is cp2 / dp2: the same
   two processes and cores, the same work, only the split differs.
4. **torch's ``context_parallel``** is tried on the same 2 ranks (CPU, gloo) on a
   causal ``F.scaled_dot_product_attention``; the script prints whether it ran and,
   if not, the error it raised.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from _timing import load_average

from mtcore.backend.collective import Collective
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.context import METHODS, shard_batch
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
VOCAB = 4096  # configs/default.yaml's data.vocab_size
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, max_grad_norm=1.0)
MIB = 2**20

# op -> (argument handed in, bytes this rank sends per byte of it, for n ranks)
_SENT_PER_BYTE = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "reduce_scatter": ("input", lambda n: (n - 1) / n),
    "all_gather": ("input", lambda n: n - 1),
    "all_to_all": ("input", lambda n: (n - 1) / n),
}


class WireCounter:
    """A ``Collective`` that forwards every call to ``inner`` and appends
    ``(op, group, bytes sent by this rank)`` to ``calls`` for the data-moving ones."""

    def __init__(self, inner: Collective):
        self.inner = inner
        self.calls: list[tuple[str, object, float]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_send_recv(self, ops):
        ops = list(ops)
        for p in ops:
            if p.kind == "send":
                self.calls.append(("send", p.group, p.tensor.numel() * p.tensor.element_size()))
        return self.inner.batch_send_recv(ops)


def _counted(op: str):
    signature = inspect.signature(getattr(Collective, op))
    argument, per_byte = _SENT_PER_BYTE[op]

    def call(self, *args, **kwargs):
        bound = signature.bind(self.inner, *args, **kwargs)
        bound.apply_defaults()
        tensor, group = bound.arguments[argument], bound.arguments["group"]
        n = self.inner.world_size(group)
        self.calls.append((op, group, tensor.numel() * tensor.element_size() * per_byte(n)))
        return getattr(self.inner, op)(*args, **kwargs)

    return call


for _op in _SENT_PER_BYTE:
    setattr(WireCounter, _op, _counted(_op))


def model_config(seq_len: int, quick: bool = False) -> GPTConfig:
    """configs/default.yaml's model at ``seq_len`` (``--quick``: a smaller one)."""
    model = yaml.safe_load(DEFAULT_CONFIG.read_text())["model"]
    if quick:
        model = {**model, "hidden_size": 64, "num_layers": 2}
    return GPTConfig(**{**model, "seq_len": seq_len, "vocab_size": VOCAB})


def expected_cp_bytes(config: GPTConfig, method: str, cp: int, seq: int) -> float:
    """Attention bytes one rank sends over cp in a step on one sequence (fp32):

    - ring: forward rotates the local K/V block ``cp-1`` times; backward rotates it
      ``cp-1`` times and its dK/dV accumulator ``cp`` times (a last hop home);
    - allgather: all-gather of the local K/V, reduce-scatter of the whole sequence's
      dK/dV: ``2 (cp-1)`` local blocks;
    - a2a: q, k, v to heads and the output back, the same again in backward:
      ``2 (cp-1)/cp`` of the local q, k, v and output.
    """
    d = config.hidden_size // config.num_heads
    token = 4 * d * seq // cp  # one head's local sequence, bytes
    kv = 2 * config.num_kv_heads * token
    per_layer = {
        "ring": (3 * cp - 2) * kv,
        "allgather": 2 * (cp - 1) * kv,
        "a2a": 2 * (cp - 1) / cp * (2 * config.num_heads * token + kv),
    }[method]
    return per_layer * config.num_layers


def saved_activation_bytes(engine: Engine, batch: dict) -> tuple[int, str]:
    """Bytes of the distinct storages one forward (and loss) saves for backward,
    parameters excluded, and the two largest saved tensors (MiB, shape, dtype); the graph
    is dropped afterwards."""
    params = {p.untyped_storage().data_ptr() for c in engine.chunks for p in c.parameters()}
    storages: dict[int, tuple[int, str]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in params:
            dtype = str(t.dtype).removeprefix("torch.")
            storages[s.data_ptr()] = (s.nbytes(), f"{list(t.shape)} {dtype}")
        return t

    model = engine.chunks[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = model.loss(model.stage({}, batch), batch)
        loss = sum(total for total, _ in terms.values())
    del loss, terms
    top = sorted(storages.values(), reverse=True)[:2]
    return sum(n for n, _ in storages.values()), "; ".join(f"{n / MIB:.1f} MiB {w}" for n, w in top)


def _sequence(seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _layout(ctx, **spec) -> ParallelLayout:
    return ParallelLayout.build(
        LayoutSpec(**spec), ctx.backend.collective, ctx.rank, ctx.world_size
    )


def _engine(config, layout, backend, microbatches: int = 1) -> Engine:
    return Engine(
        config, layout, backend, micro_batch_size=1, num_microbatches=microbatches,
        optimizer=OPT, seed=0,
    )  # fmt: skip


def _group_name(layout, group) -> str:
    return next((n for n in ("cp", "dp_cp") if layout.groups.get(n) is group), "other")


def _memory_rank(ctx, seqs: list[int], quick: bool) -> list[dict]:
    """Per (method, seq): this rank's saved activation bytes and, at cp > 1, the bytes
    it sends in one step, by group."""
    torch.set_num_threads(1)
    counter = WireCounter(ctx.backend.collective)
    ctx.backend.collective = counter
    cp, rows = ctx.world_size, []
    for method in METHODS if cp > 1 else ("none",):
        try:
            layout = _layout(ctx, cp=cp, cp_method=method) if cp > 1 else ParallelLayout.single()
            engines = {seq: _engine(model_config(seq, quick), layout, ctx.backend) for seq in seqs}
        except ValueError as e:  # a layout the model refuses (a2a: heads cp does not divide)
            rows.append({"method": method, "error": str(e)})
            continue
        for seq, engine in engines.items():
            batch = shard_batch(_sequence(seq, 0), seq, cp, layout.coordinate(Axis.CP))
            saved, largest = saved_activation_bytes(engine, batch)
            row = {"method": method, "seq": seq, "saved": saved, "largest": largest}
            if cp > 1:
                counter.calls.clear()
                engine.train_step([batch])
                by_group: dict[str, float] = {}
                for _, group, nbytes in counter.calls:
                    name = _group_name(layout, group)
                    by_group[name] = by_group.get(name, 0.0) + nbytes
                row["sent"] = by_group
                row["expected_cp"] = expected_cp_bytes(engine.config, method, cp, seq)
            rows.append(row)
    return rows


def _solo_layout(ctx) -> ParallelLayout | None:
    """A cp=1 layout for rank 0 inside a 2-rank world: every group is a one-rank group
    of rank 0 (so nothing it calls waits for rank 1). None on the other ranks."""
    solo = ctx.backend.collective.new_group([0])
    if ctx.rank != 0:
        return None
    spec = LayoutSpec().resolve(1)
    names = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "mp")
    return ParallelLayout(spec, 0, 1, dict.fromkeys(names, solo), dict.fromkeys(names, (0,)))


def _timing_rank(ctx, seq: int, rounds: int, warmup: int, quick: bool) -> dict:
    """Step times (rank 0's barrier-to-barrier windows) per configuration."""
    torch.set_num_threads(1)
    config = model_config(seq, quick)
    coll, rank = ctx.backend.collective, ctx.rank
    pair = [_sequence(seq, 1), _sequence(seq, 2)]
    solo = _solo_layout(ctx)
    steps = {}
    if solo is not None:
        engine = _engine(config, solo, ctx.backend, microbatches=2)
        steps["cp1"] = lambda e=engine: e.train_step(pair).loss
    else:
        steps["cp1"] = lambda: float("nan")
    dp = _engine(config, _layout(ctx, dp=2), ctx.backend)
    steps["dp2"] = lambda: dp.train_step([pair[rank]]).loss
    for method in METHODS:
        engine = _engine(config, _layout(ctx, cp=2, cp_method=method), ctx.backend, 2)
        local = [shard_batch(b, seq, 2, rank) for b in pair]
        steps[f"cp2 {method}"] = lambda e=engine, b=local: e.train_step(b).loss
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, float] = {}
    for r in range(warmup + rounds):
        names = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in names:
            coll.barrier()
            t0 = time.perf_counter()
            losses[name] = steps[name]()
            coll.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "losses": losses, "torch_cp": _try_torch_context_parallel(ctx)}


def _try_torch_context_parallel(ctx) -> dict[str, str]:
    """Run torch's ``context_parallel`` on a causal SDPA over the 2 gloo ranks, forward
    and backward, with SDPA's default backend choice and with the math backend forced:
    for each, "ran" or the error it raised (type and first line)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    outcome = {}
    for name, backend in (("default", None), ("math", SDPBackend.MATH)):
        chosen = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        try:
            x = torch.randn(1, 4, 64, 32, generator=torch.Generator().manual_seed(0))
            w = torch.randn(32, 32, requires_grad=True)
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]), chosen:
                q = k = v = x @ w
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            outcome[name] = "ran"
        except Exception as e:
            outcome[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return outcome


def report_memory(results: dict[int, list[list[dict]]]) -> None:
    """Per seq and method: the largest rank's saved bytes, its ratio to cp=1's, and
    that ratio times cp (target 1.0 +- 0.15)."""
    base = {row["seq"]: row["saved"] for row in results[1][0]}
    print("\nactivation memory per rank (saved for backward, one forward of one sequence)")
    print(
        f"{'cp':>3} {'method':<10} {'seq':>6} {'max MiB':>9} {'min MiB':>9} {'/cp=1':>7} {'x cp':>6}  two largest saved tensors"
    )
    for cp, ranks in results.items():
        for i, first in enumerate(ranks[0]):
            if "error" in first:
                print(f"{cp:>3} {first['method']:<10} refused: {first['error']}")
                continue
            saved = [r[i]["saved"] for r in ranks]
            ratio = max(saved) / base[first["seq"]]
            largest = max(ranks, key=lambda r, i=i: r[i]["saved"])[i]["largest"]
            print(
                f"{cp:>3} {first['method']:<10} {first['seq']:>6} {max(saved) / MIB:>9.1f} "
                f"{min(saved) / MIB:>9.1f} {ratio:>7.3f} {ratio * cp:>6.2f}  {largest}"
            )


def report_bytes(results: dict[int, list[list[dict]]]) -> None:
    """Per cp, method and seq: MiB each rank sends in a step over cp (attention, and
    the closed form) and over dp_cp (gradients, loss counts)."""
    print("\nbytes sent per rank in one step (one sequence), MiB")
    print(
        f"{'cp':>3} {'method':<10} {'seq':>6} {'cp group':>9} {'expected':>9} {'dp_cp':>8} {'other':>6}"
    )
    for cp, ranks in results.items():
        if cp == 1:
            continue
        for i, first in enumerate(ranks[0]):
            if "error" in first:
                continue
            sent = [r[i]["sent"] for r in ranks]
            attention = max(s.get("cp", 0.0) for s in sent)
            assert all(abs(s.get("cp", 0.0) - first["expected_cp"]) < 1 for s in sent), (
                f"cp={cp} {first['method']} seq {first['seq']}: counted {[s.get('cp') for s in sent]} "
                f"bytes over cp, the closed form says {first['expected_cp']}"
            )
            print(
                f"{cp:>3} {first['method']:<10} {first['seq']:>6} {attention / MIB:>9.2f} "
                f"{first['expected_cp'] / MIB:>9.2f} {max(s.get('dp_cp', 0.0) for s in sent) / MIB:>8.2f} "
                f"{max(s.get('other', 0.0) for s in sent) / MIB:>6.2f}"
            )


def report_times(out: dict, seq: int) -> None:
    times, losses = out["times"], out["losses"]
    base, dp = times["cp1"], times["dp2"]
    # The same weights and batches: every configuration trains the same model.
    assert all(abs(v - losses["cp1"]) <= 1e-4 * abs(losses["cp1"]) for v in losses.values()), losses
    print(f"\nstep time, 2 sequences of {seq} tokens per step (rank 0's window, s)")
    print(
        f"{'configuration':<15} {'median':>8} {'min':>8} {'/cp1':>7} {'paired /cp1':>12} {'paired /dp2':>12}  loss"
    )
    for name, values in times.items():

        def paired(ref, values=values):
            return statistics.median(a / b for a, b in zip(values, ref, strict=True))

        print(
            f"{name:<15} {statistics.median(values):>8.3f} {min(values):>8.3f} "
            f"{statistics.median(values) / statistics.median(base):>7.3f} {paired(base):>12.3f} "
            f"{paired(dp):>12.3f}  {losses[name]:.6f}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="memory/bytes spawns")
    ap.add_argument("--time-seq", type=int, default=2048, help="tokens per sequence, timing")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smaller model, short sequences")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.time_seq, args.rounds = [256, 512], 256, 2
    env = {"OMP_NUM_THREADS": "1"}
    print(f"load at start: {load_average()}")
    model = model_config(args.seqs[0], args.quick).describe().rsplit(", seq", 1)[0]
    print(f"model: {model}, fp32; torch {torch.__version__}")
    if not args.skip_memory:
        start = time.perf_counter()
        results = {
            cp: run_ranks(_memory_rank, cp, args.seqs, args.quick, timeout_s=3600, env=env)
            for cp in sorted(set(args.cps) | {1})
        }
        report_memory(results)
        report_bytes(results)
        print(f"(memory and bytes: {time.perf_counter() - start:.0f} s; load {load_average()})")
    if not args.skip_timing:
        start = time.perf_counter()
        ranks = run_ranks(
            _timing_rank, 2, args.time_seq, args.rounds, args.warmup, args.quick,
            timeout_s=3600, env=env,
        )  # fmt: skip
        report_times(ranks[0], args.time_seq)
        print("\ntorch.distributed.tensor.experimental.context_parallel on CPU/gloo:")
        for backend, outcome in ranks[0]["torch_cp"].items():
            print(f"  SDPA backend {backend}: {outcome}")
        print(
            f"(timing: {time.perf_counter() - start:.0f} s, {args.rounds} rounds after {args.warmup} warm-up)"
        )
    print(f"load at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
