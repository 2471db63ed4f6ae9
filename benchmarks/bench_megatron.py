"""mtcore against Megatron-Core itself: the same GPT, side by side, on CPU ranks.

    .venv/bin/pip install -c constraints.txt -r benchmarks/requirements-megatron.txt
    .venv/bin/python benchmarks/bench_megatron.py [--configs tp1 tp2 tp2-sp llama-tp2]
        [--rounds 4 --steps-per-round 3 --warmup 2] [--load K] [--ce-reps 20]
        [--compare-overlap] [--compare-shm] [--profile-steps 2] [--json]

Both sides train the same model shape from equivalent settings: 4 layers, hidden
256, 8 heads, seq 256, batch 4, vocab 1024, fp32, AdamW (lr 1e-3, betas 0.9/0.95,
no weight decay, no clipping, constant lr), one micro-batch per step, on the same
token batches (``learnable_batches``: rows that follow a fixed permutation of the
vocabulary, so the loss can fall), one torch thread per rank:

* **mtcore**: the trainer's ``mtcore.training.engine.Engine`` on the ``cpu`` backend
  (``GPTConfig(style=...)``, the layout's tp group, mtcore AdamW). Its tp group's
  all-reduce, all-gather and reduce-scatter take the cpu backend's shared-memory
  channel (``mtcore.backend.shared_memory``), as they do in ``mtcore train``; every
  other call, and all of Megatron-Core's, go through gloo. ``--compare-shm`` adds a
  side with the tp group on gloo too (``mtcore-gloo``, ``MTCORE_SHM_COLLECTIVES=0``);
* **Megatron-Core 0.16.1** (``benchmarks/requirements-megatron.txt``, never a
  dependency of mtcore): ``GPTModel`` with ``get_gpt_layer_local_spec`` (its
  pure-PyTorch modules), ``parallel_state.initialize_model_parallel``, and
  ``torch.optim.AdamW`` over the model's parameters (Megatron's own optimizer
  wrappers need its DDP and CUDA buffers).

Configurations: ``tp1`` (one rank each side: no parallel machinery), ``tp2`` and
``tp2-sp`` (2 ranks, GPT-2 style: LayerNorm, tanh-GELU, learned positions, tied
output, biases) and ``llama-tp2`` (RMSNorm, SwiGLU, RoPE, 4 kv heads of 8, untied;
Megatron's local spec expresses it on CPU). The weights are drawn by each side's own
initialiser (both normal, std 0.02), so the loss curves are compared in shape (both
start at ~ln 1024 and fall alike), not number for number.

Changes needed to run Megatron-Core on CPU; they live in this file alone:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")`` (Megatron passes it
   as the ``device=`` of its buffers); ``use_cpu_initialization=True`` builds the weights.
2. ``CudaRNGStatesTracker.fork`` is a no-op context (it swaps CUDA RNG states;
   dropout is 0 here, so no random number is drawn inside it).
3. An explicit causal ``attention_mask`` ``[1, 1, s, s]`` is passed: with ``None``
   Megatron builds its default mask on ``device="cuda"``.
4. Fusions off (``masked_softmax_fusion``, ``bias_activation_fusion``,
   ``bias_dropout_fusion``, ``gradient_accumulation_fusion``, ``apply_rope_fusion``,
   ``persist_layer_norm``): each needs Apex, Transformer Engine or CUDA extensions.
5. ``tp2-sp`` only: the local spec's ``WrappedTorchNorm`` refuses sequence parallel
   (it needs Apex's ``FusedLayerNorm``), so the norms are ``SequenceParallelNorm``
   below: ``torch.nn.LayerNorm`` whose parameters carry ``sequence_parallel = True``,
   and after backward their gradients are summed over tp, as Megatron's
   ``finalize_model_grads`` does for such parameters.

Timing: in each round every side runs ``--steps-per-round`` steps, the side that
goes first alternating from round to round, so load from other processes falls on
both alike. Reported (rank 0): median step times, the **paired ratio** (median
over rounds of mtcore's round time / Megatron's in the same round), each side's
loss per step, and a per-phase breakdown from extra instrumented steps after the
timed ones: forward (step start to the call of ``torch.autograd.backward``),
backward (inside it), optimizer and the rest (after it: gradient sync, loss
agreement, grad norm, AdamW), and tp-collective wait (time spent inside
``torch.distributed`` collectives, mtcore's shared-memory channel calls, and
``wait()`` on their handles; it overlaps
forward and backward, it is not added to them). The vocabulary-parallel cross
entropy of both on the same ``[1024, 512]`` logit shards is timed the same way,
forward and forward+backward (``--ce-reps``; tp2 configurations).

``--profile-steps`` (default 2) profiles extra steps of each side with
``torch.profiler``: the time in matrix products (``aten::mm``/``addmm``/``bmm``/
``baddbmm``; Megatron's unfused attention's score products among them) and in fused
attention kernels, and a **GEMM floor**: the step's weight-product FLOPs per rank
over this core's measured single-thread matmul rate, beside 0.7 x Megatron's step.

``--compare-overlap`` runs two mtcore sides against the same Megatron steps: the
column-parallel backward overlapped (``mtcore``, ``MTCORE_TP_OVERLAP=1``, the default)
and blocking (``mtcore-blocking``, ``=0``). ``--load K`` starts K processes that spin
on the CPU for the length of the run (``spin_load``), so the shared-machine case is
measured on purpose. The ``uptime``
line is printed at the start and at the end of every configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 1024, 256, 4, 8, 256, 4
LLAMA_KV_HEADS = 4
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8
CONFIGS = {
    "tp1": dict(tp=1, sp=False, style="gpt2"),
    "tp2": dict(tp=2, sp=False, style="gpt2"),
    "tp2-sp": dict(tp=2, sp=True, style="gpt2"),
    "llama-tp2": dict(tp=2, sp=False, style="llama"),
}


# -- reproducible background load -------------------------------------------------------
def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


@contextlib.contextmanager
def spin_load(k: int):
    """K processes spinning on integer arithmetic until the block ends (K = 0: none)."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


# -- instrumentation: collective wait and phase boundaries ------------------------------
class Clock:
    """Seconds inside torch.distributed collectives (and their handles' ``wait``), and
    the entry and exit times of ``torch.autograd.backward``, while ``on``."""

    def __init__(self):
        self.on, self.comm, self.calls, self.bwd_start, self.bwd_end = False, 0.0, 0, None, None

    def reset(self):
        self.comm, self.calls, self.bwd_start, self.bwd_end = 0.0, 0, None, None


CLOCK = Clock()


class _TimedWork:
    def __init__(self, work):
        self._work = work

    def wait(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*a, **k)
        finally:
            CLOCK.comm += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed_collective(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not CLOCK.on:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        CLOCK.comm += time.perf_counter() - t0
        CLOCK.calls += 1
        return _TimedWork(out) if kwargs.get("async_op") and out is not None else out

    return call


def _timed_backward(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not CLOCK.on:
            return fn(*args, **kwargs)
        CLOCK.bwd_start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.bwd_end = time.perf_counter()

    return call


def instrument() -> None:
    """Wrap the collectives both sides call (torch.distributed's, and mtcore's
    shared-memory channel) and ``torch.autograd.backward``; before Megatron is imported
    (it binds ``all_gather_into_tensor`` at import)."""
    import torch.distributed as dist

    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    # Newer torch has *_single forms, which mtcore's Collective prefers when present.
    for name in (*names, "all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, _timed_collective(getattr(dist, name)))
    torch.autograd.backward = _timed_backward(torch.autograd.backward)
    # mtcore's tp groups run through its shared-memory channel, not torch.distributed
    from mtcore.backend.shared_memory import SharedMemoryChannel

    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        setattr(SharedMemoryChannel, name, _timed_collective(getattr(SharedMemoryChannel, name)))


# -- Megatron-Core on CPU ----------------------------------------------------------------
def megatron_on_cpu() -> None:
    """Changes 1 and 2 of the module docstring."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


class SequenceParallelNorm(torch.nn.LayerNorm):
    """Change 5: a LayerNorm for Megatron's spec that sequence parallel accepts."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True


def _ffn_size(style: str) -> int:
    from mtcore.models.gpt import GPTConfig

    return _mtcore_config(style, GPTConfig).ffn_size


def _mtcore_config(style, GPTConfig):
    kv = LLAMA_KV_HEADS if style == "llama" else None
    return GPTConfig(
        style=style, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
        num_heads=HEADS, num_kv_heads=kv, seq_len=SEQ,
    )  # fmt: skip


class MegatronSide:
    def __init__(self, tp: int, sp: bool, style: str):
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        llama = style == "llama"
        norm = "RMSNorm" if llama else "LayerNorm"
        cfg = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
            num_query_groups=LLAMA_KV_HEADS if llama else None, ffn_hidden_size=_ffn_size(style),
            use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.02,
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
            sequence_parallel=sp, normalization=norm, gated_linear_unit=llama,
            activation_func=F.silu if llama else functools.partial(F.gelu, approximate="tanh"),
            add_bias_linear=not llama, masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, gradient_accumulation_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False,
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(normalization=norm)
        if sp:
            from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

            spec.submodules.input_layernorm = SequenceParallelNorm
            spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
            spec = TransformerBlockSubmodules([spec] * LAYERS, layer_norm=SequenceParallelNorm)
        self.model = GPTModel(
            cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            position_embedding_type="rope" if llama else "learned_absolute",
            share_embeddings_and_output_weights=not llama,
        )  # fmt: skip
        self.sp_params = [
            p for p in self.model.parameters() if getattr(p, "sequence_parallel", False)
        ]
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0
        )
        self.mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # change 3
        self.positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)

    def step(self, tokens, labels) -> float:
        import torch.distributed as dist

        self.opt.zero_grad(set_to_none=True)
        loss = self.model(tokens, self.positions, self.mask, labels=labels).mean()
        loss.backward()
        if self.sp_params:  # change 5: as finalize_model_grads, one flat all-reduce
            grads = [p.grad for p in self.sp_params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.tp_group)
            for g, summed in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                g.copy_(summed)
        self.opt.step()
        return loss.item()


class MtcoreSide:
    def __init__(
        self, ctx, tp: int, sp: bool, style: str, overlap: str | None = None, shm: str = "1"
    ):
        from mtcore.backend.collective import SHARED_MEMORY_ENV
        from mtcore.distributed import LayoutSpec, ParallelLayout
        from mtcore.models.gpt import GPTConfig
        from mtcore.training.config import OptimizerConfig
        from mtcore.training.engine import Engine

        before = os.environ.get(SHARED_MEMORY_ENV)
        os.environ[SHARED_MEMORY_ENV] = shm  # read when the tp group is made
        try:
            layout = ParallelLayout.build(
                LayoutSpec(tp=tp, sequence_parallel=sp),
                ctx.backend.collective,
                ctx.rank,
                ctx.world_size,
            )
        finally:
            if before is None:
                os.environ.pop(SHARED_MEMORY_ENV)
            else:
                os.environ[SHARED_MEMORY_ENV] = before
        opt = OptimizerConfig(
            lr=LR, min_lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, warmup_steps=0,
            max_grad_norm=None,
        )  # fmt: skip
        self.engine = Engine(
            _mtcore_config(style, GPTConfig), layout, ctx.backend,
            micro_batch_size=BATCH, num_microbatches=1, optimizer=opt, seed=0,
        )  # fmt: skip
        self.engine.set_lr(LR)
        self.overlap = overlap  # MTCORE_TP_OVERLAP for this side's steps (None: as set)

    def step(self, tokens, labels) -> float:
        from mtcore.parallel.tensor.linear import OVERLAP_ENV

        before = os.environ.get(OVERLAP_ENV)
        if self.overlap is not None:
            os.environ[OVERLAP_ENV] = self.overlap
        try:
            return self.engine.train_step([{"tokens": tokens, "labels": labels}]).loss
        finally:
            if before is None:
                os.environ.pop(OVERLAP_ENV, None)
            else:
                os.environ[OVERLAP_ENV] = before


# -- the rank's work ---------------------------------------------------------------------
def _phases(step, batch) -> dict[str, float]:
    CLOCK.reset()
    CLOCK.on = True
    t0 = time.perf_counter()
    step(*batch)
    end = time.perf_counter()
    CLOCK.on = False
    return {
        "forward": CLOCK.bwd_start - t0,
        "backward": CLOCK.bwd_end - CLOCK.bwd_start,
        "optimizer+rest": end - CLOCK.bwd_end,
        "tp-collective wait": CLOCK.comm,
        "step": end - t0,
        "collective calls": CLOCK.calls,
    }


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _op_times(step, batches) -> dict[str, float]:
    """Seconds per step, from ``torch.profiler`` self CPU times (rank 0, separate steps:
    the profiler slows what it watches): the matrix products (``MATMUL_OPS``, which
    include an unfused attention's score products) and fused attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(*batch)
    out = {"matmul": 0.0, "fused attention": 0.0}
    for event in prof.key_averages():
        if event.key in MATMUL_OPS:
            out["matmul"] += event.self_cpu_time_total
        elif "scaled_dot_product" in event.key:
            out["fused attention"] += event.self_cpu_time_total
    return {k: v / 1e6 / len(batches) for k, v in out.items()}


def weight_flops_per_rank(style: str, tp: int) -> float:
    """FLOPs of one step's weight products on one tp rank (forward + 2 backward):
    ``6 x tokens x weights / tp``, the embedding's lookup excluded, the output layer in."""
    kv = (LLAMA_KV_HEADS if style == "llama" else HEADS) * (HIDDEN // HEADS)
    attention = HIDDEN * (HIDDEN + 2 * kv) + HIDDEN * HIDDEN
    mlp = (3 if style == "llama" else 2) * HIDDEN * _ffn_size(style)
    weights = LAYERS * (attention + mlp) + VOCAB * HIDDEN
    return 6.0 * BATCH * SEQ * weights / tp


def gemm_peak_flops(reps: int = 30) -> float:
    """This core's fp32 matmul rate, one thread, on the MLP's first product at tp=2
    ([batch x seq, hidden] @ [hidden, 2 hidden])."""
    a, b = torch.randn(BATCH * SEQ, HIDDEN), torch.randn(HIDDEN, 4 * HIDDEN // 2)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (time.perf_counter() - t0)


def _cross_entropy_times(ctx, reps: int) -> dict[str, dict[str, float]]:
    """Both vocab-parallel cross entropies on the same logit shard, alternating."""
    from megatron.core import tensor_parallel

    from mtcore.distributed import LayoutSpec, ParallelLayout
    from mtcore.parallel.tensor import TPGroup, vocab_parallel_cross_entropy

    layout = ParallelLayout.build(
        LayoutSpec(tp=2), ctx.backend.collective, ctx.rank, ctx.world_size
    )
    tp = TPGroup.from_layout(layout, ctx.backend)
    g = torch.Generator().manual_seed(5)
    n = BATCH * SEQ
    logits = torch.randn(n, VOCAB, generator=g).chunk(2, dim=1)[ctx.rank].contiguous()
    target = torch.randint(0, VOCAB, (n,), generator=g)
    sides = {
        "mtcore": lambda x: vocab_parallel_cross_entropy(x, target, tp),
        "megatron": lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target),
    }
    diff = (sides["mtcore"](logits) - sides["megatron"](logits.clone())).abs().max().item()
    out = {name: {"forward": [], "forward+backward": []} for name in sides}
    for i in range(reps + 2):
        for name in sorted(sides, reverse=bool(i % 2)):
            x = logits.clone().requires_grad_(True)
            t0 = time.perf_counter()
            with torch.no_grad():
                sides[name](x.detach().clone())
            t1 = time.perf_counter()
            sides[name](x).sum().backward()
            t2 = time.perf_counter()
            if i >= 2:
                out[name]["forward"].append(t1 - t0)
                out[name]["forward+backward"].append(t2 - t1)
    res = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in out.items()}
    res["max |loss difference|"] = diff
    return res


def learnable_batches(n: int) -> torch.Tensor:
    """``[n, batch, seq + 1]`` token rows that follow a fixed random permutation of the
    vocabulary (``next = perm[current]``) from random starts: a loss that can fall from
    ln V towards 0 (uniform random tokens would keep both sides at ln V)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(VOCAB, generator=g)
    rows = [torch.randint(0, VOCAB, (n, BATCH), generator=g)]
    for _ in range(SEQ):
        rows.append(perm[rows[-1]])
    return torch.stack(rows, dim=-1)


def rank_main(
    ctx, name: str, rounds: int, per_round: int, warmup: int, phase_steps: int, ce_reps: int,
    compare_overlap: bool, profile_steps: int = 0, compare_shm: bool = False,
):  # fmt: skip
    torch.set_num_threads(1)
    instrument()
    megatron_on_cpu()
    cfg = CONFIGS[name]
    sides = {"mtcore": MtcoreSide(ctx, **cfg).step}
    if compare_overlap:  # the same engine twice: overlapped (default) and blocking tp backward
        sides = {
            "mtcore": MtcoreSide(ctx, **cfg, overlap="1").step,
            "mtcore-blocking": MtcoreSide(ctx, **cfg, overlap="0").step,
        }
    if compare_shm and cfg["tp"] > 1:  # mtcore's tp group on gloo, as Megatron's is
        sides["mtcore-gloo"] = MtcoreSide(ctx, **cfg, shm="0").step
    sides["megatron"] = MegatronSide(**cfg).step
    total = warmup + rounds * per_round + phase_steps + profile_steps
    data = learnable_batches(total)
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    losses = {s: [] for s in sides}
    times = {s: [] for s in sides}
    for i in range(warmup):
        for s, step in sides.items():
            losses[s].append(step(*batches[i]))
    for r in range(rounds):
        order = (
            list(sides)[r % len(sides) :] + list(sides)[: r % len(sides)]
        )  # who goes first rotates
        for s in order:
            spent = 0.0
            for j in range(per_round):
                i = warmup + r * per_round + j
                t0 = time.perf_counter()
                losses[s].append(sides[s](*batches[i]))
                spent += time.perf_counter() - t0
            times[s].append(spent / per_round)
    phases = {s: [] for s in sides}
    for k in range(phase_steps):
        i = warmup + rounds * per_round + k
        for s in list(sides)[k % len(sides) :] + list(sides)[: k % len(sides)]:
            phases[s].append(_phases(sides[s], batches[i]))
    phase_median = {
        s: {key: statistics.median(p[key] for p in ps) for key in ps[0]} for s, ps in phases.items()
    }
    result = {"round_times": times, "losses": losses, "phases": phase_median}
    if profile_steps:
        extra = batches[-profile_steps:]
        result["ops"] = {s: _op_times(sides[s], extra) for s in sides}
        result["gemm_peak"] = gemm_peak_flops()
        result["weight_flops"] = weight_flops_per_rank(cfg["style"], cfg["tp"])
    if cfg["tp"] == 2 and ce_reps:
        result["cross_entropy"] = _cross_entropy_times(ctx, ce_reps)
    return result


# -- the report ----------------------------------------------------------------------------
def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def report(name: str, res: dict) -> dict:
    t = res["round_times"]
    ours = [s for s in t if s != "megatron"]
    med = {s: statistics.median(v) for s, v in t.items()}
    paired = {s: _paired(t[s], t["megatron"]) for s in ours}
    print(f"\n## {name}: {CONFIGS[name]}")
    print(
        "step ms (median of round means): "
        + ", ".join(f"{s} {v * 1e3:.1f}" for s, v in med.items())
    )
    for s in ours:
        rounds = ", ".join(f"{x / y:.3f}" for x, y in zip(t[s], t["megatron"], strict=True))
        print(f"{s} / megatron: paired ratio {paired[s]:.3f} over {len(t[s])} rounds ({rounds})")
    for s, ls in res["losses"].items():
        print(f"loss {s:<15}: " + " ".join(f"{v:.3f}" for v in ls))
    print(f"{'phase ms':<20}" + "".join(f"{s:>16}" for s in t))
    for key in res["phases"]["megatron"]:
        scale, fmt = (1, ".0f") if key == "collective calls" else (1e3, ".1f")
        print(f"{key:<20}" + "".join(f"{res['phases'][s][key] * scale:>16{fmt}}" for s in t))
    if "ops" in res:
        peak, flops = res["gemm_peak"], res["weight_flops"]
        print(
            f"{'matmul ms (profiled)':<20}"
            + "".join(f"{res['ops'][s]['matmul'] * 1e3:>16.1f}" for s in t)
        )
        print(
            f"{'fused attention ms':<20}"
            + "".join(f"{res['ops'][s]['fused attention'] * 1e3:>16.1f}" for s in t)
        )
        floor = flops / peak
        print(
            f"GEMM floor: {flops / 1e9:.2f} GFLOP of weight products per rank per step at this "
            f"core's {peak / 1e9:.0f} GFLOP/s = {floor * 1e3:.1f} ms; 0.7 x Megatron's step = "
            f"{0.7 * med['megatron'] * 1e3:.1f} ms"
        )
    ce = res.get("cross_entropy")
    if ce:
        print(f"vocab-parallel cross entropy [{BATCH * SEQ}, {VOCAB // 2}] per rank, ms (median):")
        for part in ("forward", "forward+backward"):
            a, b = ce["mtcore"][part], ce["megatron"][part]
            print(f"  {part:<17} mtcore {a * 1e3:.2f}  megatron {b * 1e3:.2f}  ratio {a / b:.3f}")
        print(f"  max |loss difference| {ce['max |loss difference|']:.2e}")
    return {"paired": paired, "ms": {s: v * 1e3 for s, v in med.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--phase-steps", type=int, default=4, help="instrumented steps per side")
    parser.add_argument("--ce-reps", type=int, default=20, help="cross-entropy timings (0: skip)")
    parser.add_argument(
        "--profile-steps", type=int, default=2,
        help="profiled steps per side for the matmul/attention times and GEMM floor (0: skip)",
    )  # fmt: skip
    parser.add_argument("--load", type=int, default=0, metavar="K", help="K spinning processes")
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="two mtcore sides: MTCORE_TP_OVERLAP=1 (overlapped, default) and =0 (blocking)",
    )
    parser.add_argument(
        "--compare-shm",
        action="store_true",
        help="a second mtcore side with its tp group on gloo (MTCORE_SHM_COLLECTIVES=0)",
    )
    parser.add_argument("--json", action="store_true", help="also print the raw results")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps_per_round < 1 or args.phase_steps < 1:
        parser.error("--rounds, --steps-per-round and --phase-steps must be >= 1")
    from mtcore.testing.distributed import run_ranks

    summary = {}
    with spin_load(args.load):
        print(f"background load: {args.load} spinning process(es); 1 torch thread per rank")
        for name in args.configs:
            print(f"\nload at start of {name}: {load_average()}")
            res = run_ranks(
                rank_main, CONFIGS[name]["tp"], name, args.rounds, args.steps_per_round,
                args.warmup, args.phase_steps, args.ce_reps, args.compare_overlap,
                args.profile_steps, args.compare_shm, timeout_s=1800,
                env={"OMP_NUM_THREADS": "1"},
            )[0]  # fmt: skip
            summary[name] = report(name, res)
            print(f"load at end of {name}: {load_average()}")
            if args.json:
                print(json.dumps(res))
    print("\n| config | side | step ms | megatron ms | paired ratio |\n|---|---|---|---|---|")
    for name, s in summary.items():
        for side, ratio in s["paired"].items():
            print(
                f"| {name} | {side} | {s['ms'][side]:.1f} | {s['ms']['megatron']:.1f} | {ratio:.3f} |"
            )


if __name__ == "__main__":
    main()
