"""The equivalence harness: any parallel layout of a family trains as one process does.

Every in-tree family's equivalence tests use it, and a family from another
distribution tests itself with it (docs/plugin-author-guide.md, "Checking it")::

    from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn

    SETUP = Setup(models={"base": MyConfig(vocab_size=64, ...)}, optimizer=OPT,
                  batch_size=8, micro_batch_size=2, seed=5)
    CASES = {"tp2": Case(2, "base", {"tp": 2}), "tp2_pp2": Case(4, "base", {"tp": 2, "pp": 2})}

    @pytest.fixture(scope="module")
    def runs():
        return spawn(SETUP, CASES, batches)   # one spawn per world size, then the references

    @pytest.mark.parametrize("case", list(CASES))
    def test_layout_matches_one_process(runs, case):
        assert_matches(SETUP, case, CASES[case], *runs[case])

Each case runs the trainer's own ``Engine`` (DataParallel, AdamW or ZeRO-1, the
pipeline runner) on every rank for one optimizer step per global batch: each dp rank
takes its rows of the batch, cut into micro-batches, and each cp rank its share of
every sequence. The reference is a one-process ``Engine`` on the whole batches (by
default each global batch as one micro-batch: the plain token-weighted mean), run in
the calling process. ``assert_matches`` compares, on every rank, the loss and each
loss term of every step, the gradient norm, the mixture-of-experts load statistics,
the evaluation loss and metrics, and (gathered whole on rank 0) every gradient of the
first step and the weights after the last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import RankContext, run_ranks

Batch = dict[str, torch.Tensor]
Batches = Sequence[Batch] | Mapping[str, Sequence[Batch]]
"""One global batch per step, for every model, or per model name."""


@dataclass(frozen=True)
class Case:
    """A layout to compare: ``world`` ranks, the model ``model`` (a key of
    ``Setup.models``), ``LayoutSpec`` keywords, ZeRO-1 or not, the pipeline
    ``schedule`` (``parallel.schedule``; with pp=1 there is none) and the ZeRO stage
    ``zero`` (``parallel.zero``; ``zero1=True`` is stage 1)."""

    world: int
    model: str
    layout: Mapping[str, Any]
    zero1: bool = False
    schedule: str = "1f1b"
    zero: int = 0

    @property
    def stage(self) -> int:
        return max(self.zero, int(self.zero1))


@dataclass(frozen=True)
class Setup:
    """What every case of a test shares. ``reference_micro_batch_size``: the one-process
    run's micro-batch (None: the whole global batch). ``first_step_grads``: gather the
    first step's reduced gradients (not under ZeRO-1). ``probe(engine, record)``: a
    module-level function adding records of its own after the steps (it is pickled to
    the ranks); ``extras(ctx)``: one more module-level function each spawn runs on every
    rank after the cases (its results are ``Runs.extras[world]``). ``lora``: a
    ``LoRAConfig`` every engine (the reference's too) fine-tunes its model with, or a
    mapping from model name to one (a model not in it is trained whole)."""

    models: Mapping[str, Any]
    optimizer: Any  # mtcore.training.config.OptimizerConfig
    batch_size: int
    micro_batch_size: int
    seed: int = 0
    bucket_size: int | None = 700
    reference_micro_batch_size: int | None = None
    first_step_grads: bool = True
    evaluate: bool = True
    initial_weights: bool = False
    probe: Callable[[Any, dict], None] | None = None
    extras: Callable[[RankContext], Any] | None = None
    rtol: float = 1e-5
    lora: Any = None


@dataclass
class Runs:
    """``runs[name]``: ``(records by rank, reference record)``; ``extras[world]``: what
    ``Setup.extras`` returned on each rank of that spawn."""

    cases: dict[str, tuple[list[dict], dict]] = field(default_factory=dict)
    extras: dict[int, list] = field(default_factory=dict)

    def __getitem__(self, name: str) -> tuple[list[dict], dict]:
        return self.cases[name]


def token_batches(steps: int, batch_size: int, seq_len: int, vocab: int, seed: int = 7
                  ) -> list[Batch]:  # fmt: skip
    """``steps`` global batches of random ``{"tokens", "labels"}`` in ``[0, vocab)``, for a
    next-token model (the tokens first, then the labels, from one generator)."""
    g = torch.Generator().manual_seed(seed)
    shape = (steps, batch_size, seq_len)
    tokens = torch.randint(0, vocab, shape, generator=g)
    labels = torch.randint(0, vocab, shape, generator=g)
    return [{"tokens": tokens[step], "labels": labels[step]} for step in range(steps)]


def micro_batches(batch: Batch, rows: slice, size: int, seq_len: int | Mapping | None = None,
                  cp: int = 1, cp_rank: int = 0) -> list[Batch]:  # fmt: skip
    """``rows`` of a global batch cut into micro-batches of ``size``; under cp > 1, this
    cp rank's share of each sequence (``mtcore.parallel.context.shard_batch``)."""
    local = {name: t[rows] for name, t in batch.items()}
    count = next(iter(local.values())).shape[0]
    micro = [{n: t[i : i + size] for n, t in local.items()} for i in range(0, count, size)]
    if cp == 1:
        return micro
    from mtcore.parallel.context import shard_batch

    return [shard_batch(mb, seq_len, cp, cp_rank) for mb in micro]


def full_gradients(engine) -> dict[str, torch.Tensor] | None:
    """The reduced (and clipped) gradients, gathered whole like the weights (on global
    rank 0; None elsewhere): the parameters are pointed at their gradient buffers for one
    ``full_state_dict``. A frozen parameter (no gradient buffer) reports zeros."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p) if hasattr(p, "main_grad") else torch.zeros_like(p)
    try:
        return engine.full_state_dict()
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def make_engine(setup: Setup, model: str, layout, backend, micro_batch_size: int,
                local_batch: int, zero: int = 0, schedule: str = "1f1b"):  # fmt: skip
    """The trainer's ``Engine`` for ``setup.models[model]`` on ``layout``."""
    from mtcore.training.engine import Engine

    lora = setup.lora.get(model) if isinstance(setup.lora, Mapping) else setup.lora
    return Engine(setup.models[model], layout, backend, micro_batch_size=micro_batch_size,
                  num_microbatches=local_batch // micro_batch_size, optimizer=setup.optimizer,
                  seed=setup.seed, zero=zero, bucket_size=setup.bucket_size,
                  schedule=schedule, lora=lora)  # fmt: skip


def record_run(setup: Setup, engine, batches: Sequence[Batch], rows: slice, size: int,
               cp: int = 1, cp_rank: int = 0, grads: bool = True) -> dict:  # fmt: skip
    """One step per global batch on this rank's share; what ``assert_matches`` compares."""
    from mtcore.models import family_of

    seq_len = family_of(engine.config).sequence_lengths(engine.config)
    out: dict[str, Any] = {"loss": [], "terms": [], "norm": [], "moe": []}
    if setup.initial_weights:
        out["initial"] = engine.full_state_dict()
    for step, batch in enumerate(batches):
        result = engine.train_step(micro_batches(batch, rows, size, seq_len, cp, cp_rank))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        out["terms"].append(result.terms)
        out["norm"].append(result.grad_norm)
        out["moe"].append(result.moe)  # load statistics; None for a dense model
        if step == 0 and grads and setup.first_step_grads:
            out["grads"] = full_gradients(engine)
    if setup.evaluate:
        out["eval"] = engine.evaluate(micro_batches(batches[0], rows, size, seq_len, cp, cp_rank))
    out["weights"] = engine.full_state_dict()
    if setup.probe is not None:
        setup.probe(engine, out)
    return out


def _batches_of(batches: Batches, model: str) -> Sequence[Batch]:
    return batches[model] if isinstance(batches, Mapping) else batches


def _rank_main(ctx: RankContext, setup: Setup, cases: Mapping[str, Case], batches: Batches):
    from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout

    results = {}
    for name, case in cases.items():
        spec = LayoutSpec(**case.layout)
        layout = ParallelLayout.build(spec, ctx.backend.collective, ctx.rank, case.world)
        local = setup.batch_size // layout.size(Axis.DP)
        rows = slice(layout.coordinate(Axis.DP) * local, (layout.coordinate(Axis.DP) + 1) * local)
        engine = make_engine(setup, case.model, layout, ctx.backend, setup.micro_batch_size,
                             local, case.stage, case.schedule)  # fmt: skip
        results[name] = record_run(setup, engine, _batches_of(batches, case.model), rows,
                                   setup.micro_batch_size, layout.cp, layout.coordinate(Axis.CP),
                                   grads=not case.stage)  # fmt: skip
    extras = setup.extras(ctx) if setup.extras is not None else None
    return results, extras


def reference(setup: Setup, model: str, batches: Sequence[Batch]) -> dict:
    """The one-process run of ``model`` on the whole batches (one CPU thread)."""
    from mtcore.backend import select_backend
    from mtcore.parallel.layout import ParallelLayout

    size = setup.reference_micro_batch_size or setup.batch_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(setup, model, ParallelLayout.single(), select_backend("cpu"), size,
                             setup.batch_size)  # fmt: skip
        return record_run(setup, engine, batches, slice(None), size)
    finally:
        torch.set_num_threads(threads)


def spawn(setup: Setup, cases: Mapping[str, Case], batches: Batches) -> Runs:
    """Every case, one ``run_ranks`` per world size (smallest first), and the one-process
    reference of each model they use."""
    runs, references = Runs(), {}
    for world in sorted({case.world for case in cases.values()}):
        group = {name: case for name, case in cases.items() if case.world == world}
        ranks = run_ranks(_rank_main, world, setup, group, batches)
        runs.extras[world] = [extras for _, extras in ranks]
        for name, case in group.items():
            if case.model not in references:
                references[case.model] = reference(
                    setup, case.model, _batches_of(batches, case.model)
                )
            runs.cases[name] = ([results[name] for results, _ in ranks], references[case.model])
    return runs


def close(got: float, want: float, rtol: float, floor: float = 1e-6) -> bool:
    """``|got - want| <= rtol * max(|want|, floor)``."""
    return abs(got - want) <= rtol * max(abs(want), floor)


def assert_matches(setup: Setup, name: str, case: Case, ranks: list[dict], ref: dict,
                   eval_names: set[str] | None = None, moe_floor: float = 1e-6) -> None:  # fmt: skip
    """Every rank's record equals the reference within ``setup.rtol``: loss, terms and
    gradient norm of every step, MoE load statistics (relative to ``max(|value|,
    moe_floor)``), evaluation values (their names ``eval_names`` when given), and on rank 0
    the gathered first-step gradients (not under ZeRO-1, whose ranks hold shards) and
    final weights, which no other rank returns."""
    rtol, steps = setup.rtol, len(ref["loss"])
    for rank, got in enumerate(ranks):
        for step in range(steps):
            where = f"{name} rank {rank} step {step}"
            assert close(got["loss"][step], ref["loss"][step], rtol), (
                where,
                got["loss"],
                ref["loss"],
            )
            for term, value in ref["terms"][step].items():
                assert close(got["terms"][step][term], value, rtol), (where, term)
            assert close(got["norm"][step], ref["norm"][step], rtol), (
                where,
                got["norm"],
                ref["norm"],
            )
            want_moe, got_moe = ref["moe"][step], got["moe"][step]
            assert (got_moe is None) == (want_moe is None), where
            for key, value in (want_moe or {}).items():
                assert close(got_moe[key], value, rtol, moe_floor), (where, "moe", key)
        if setup.evaluate:
            assert set(got["eval"]) == set(ref["eval"]), (name, rank, sorted(got["eval"]))
            assert eval_names is None or set(got["eval"]) == eval_names, (name, sorted(got["eval"]))
            for metric, value in ref["eval"].items():
                assert close(got["eval"][metric], value, rtol), (name, rank, metric)
        assert rank == 0 or got["weights"] is None, "only rank 0 gathers the weights"
    wanted = ["weights"] + (["grads"] if setup.first_step_grads and not case.stage else [])
    for what in wanted:
        gathered = ranks[0][what]
        assert gathered is not None and set(gathered) == set(ref[what]), (name, what)
        for tensor, want in ref[what].items():
            err = rel_error(gathered[tensor], want)
            assert err <= rtol, f"{name}: {what} {tensor}: rel err {err:.2e}"
