"""A MoE GPT trains the same under expert parallelism as in one process (gloo, one spawn).

Each case runs the trainer's ``Engine`` on 4 ranks for a few steps, fp32, with
gradient clipping, and compares with a one-process ``Engine`` on the same
micro-batches (each dp rank takes its rows of the global batch, cut into the same
micro-batches): the loss and gradient norm of every step, the final full
gradients and the final full weights (expert biases included), relative error
<= 1e-5. Both dispatchers, dropless:

* model ``a2a``: all-to-all dispatch, every layer MoE, batch aux loss + z-loss;
* model ``ag``: all-gather dispatch, MoE in every other layer, per-sequence aux
  loss, a shared expert and auxiliary-loss-free expert biases (updated from the
  load summed over dp, so they must match too).

Layouts: ep2 (dp4: expert-data-parallel pairs), ep4, ep2 x tp2, ep2 x tp2 with
sequence parallel, ep2 with pp2, and ep2 with ZeRO-1 (expert state sharded over
edp). Plus model ``cap`` (capacity factor 1.0, tokens dropped) at ep4: the same
fraction dropped, and the same losses and weights, so the same tokens. And
model ``first`` (only layer 0 MoE) at ep2 + pp2 x vpp2: a pipeline rank
without MoE layers still joins the load and norm reductions. And model ``dedup``
(the ``alltoall_dedup`` dispatcher) at ep2 x tp2.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.gpt import GPTConfig, lm_batches
from mtcore.parallel.clip import clip_grad_norm_
from mtcore.parallel.tensor import full_tensor, named_tp_parameters
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine
from mtcore.training.moe import gather_experts

RTOL = 1e-5
WORLD, STEPS, BATCH, MB = 4, 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MOE = dict(num_experts=4, top_k=2, ffn_size=32)
MODELS = {
    "a2a": GPTConfig(init_std=0.1, moe=dict(MOE, z_loss_coeff=1e-2), **SIZES),
    "ag": GPTConfig(
        init_std=0.1,
        moe_layer_freq=2,
        moe=dict(
            MOE,
            dispatcher="allgather",
            aux_loss="seq",
            shared_ffn_size=16,
            bias_update_rate=1e-2,
        ),
        **SIZES,
    ),
    "cap": GPTConfig(init_std=0.1, moe=dict(MOE, capacity_factor=1.0), **SIZES),
    "dedup": GPTConfig(init_std=0.1, moe=dict(MOE, dispatcher="alltoall_dedup"), **SIZES),
    "first": GPTConfig(
        init_std=0.1, moe_layer_freq=4, moe=dict(MOE, bias_update_rate=1e-2), **SIZES
    ),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (model, layout, zero1); every layout on 4 ranks.
LAYOUTS = {
    "ep2": (dict(ep=2), False),
    "ep4": (dict(ep=4), False),
    "ep2_tp2": (dict(ep=2, tp=2), False),
    "ep2_tp2_sp": (dict(ep=2, tp=2, sequence_parallel=True), False),
    "ep2_pp2": (dict(ep=2, pp=2), False),
    "ep2_zero1": (dict(ep=2), True),
}
CASES = {
    f"{layout}_{model}": (model, *LAYOUTS[layout])
    for layout in LAYOUTS
    for model in ("a2a", "ag")
    if not (layout == "ep2_tp2_sp" and model == "ag")  # SP once is enough
}
CASES["ep4_cap"] = ("cap", *LAYOUTS["ep4"])  # capacity 1.0: the same tokens dropped
CASES["ep2_tp2_dedup"] = ("dedup", *LAYOUTS["ep2_tp2"])  # the third dispatcher
# Only layer 0 is MoE: with interleaving, pipeline rank 1 (layers 1 and 3) has no experts.
CASES["ep2_pp2_vpp2_first"] = ("first", dict(ep=2, pp=2, vpp=2), False)


def _batches():
    g = torch.Generator().manual_seed(7)
    shape = (STEPS, BATCH, SIZES["seq_len"])
    return torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g)


def _full_grads(engine: Engine) -> dict | None:
    """The last step's reduced (clipped) gradients, whole, on dp index 0 / tp rank 0."""
    if engine.optimizer.sharded or engine.layout.coordinate("edp") != 0:
        return None
    out = {}
    for chunk in engine.chunks:
        grads = {
            name: full_tensor(p.main_grad, chunk.tp, partition)
            for name, p, partition, _ in named_tp_parameters(chunk)
        }
        gather_experts(chunk, grads, engine.layout, engine.collective)
        out.update(grads)
    lead = engine.layout.tp_rank == 0 and engine.layout.coordinate("dp_cp") == 0
    return out if lead else None


def _run(engine: Engine, tokens, targets, rows: slice):
    out = {"loss": [], "norm": [], "moe": []}
    for step in range(STEPS):
        x, y = tokens[step][rows].split(MB), targets[step][rows].split(MB)
        result = engine.train_step(lm_batches(x, y))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
        out["moe"].append(result.moe)
    out["grads"] = _full_grads(engine)
    out["plain_norm"] = None  # clip_grad_norm_ (gradients held whole) on the same gradients
    if not engine.optimizer.sharded:
        params = [p for chunk in engine.chunks for p in chunk.parameters()]
        out["plain_norm"] = clip_grad_norm_(params, 1e30, engine.layout, engine.collective)
    out["weights"] = engine.full_state_dict()
    return out


def _engine(model: str, layout, backend, zero1: bool = False) -> Engine:
    local = BATCH // layout.size("dp_cp")
    return Engine(
        MODELS[model],
        layout,
        backend,
        micro_batch_size=MB,
        num_microbatches=local // MB,
        optimizer=OPT,
        seed=3,
        zero1=zero1,
        bucket_size=700,
    )


def _rank_main(ctx, names, tokens, targets):
    results = {}
    for name in names:
        model, layout_kw, zero1 = CASES[name]
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, WORLD
        )
        engine = _engine(model, layout, ctx.backend, zero1)
        if zero1:  # expert state is sharded over edp: half of the experts' elements per rank
            expert_state = sum(
                s.numel for s in engine.optimizer.segments if s.buffer.reduce_group == "edp"
            )
            expert_params = sum(b.numel for b in engine.ddp.grad_buffers if b.reduce_group == "edp")
            results[f"{name}/sharded"] = (expert_state, expert_params)
        local = BATCH // layout.size("dp_cp")
        dp_rank = layout.coordinate("dp_cp")
        results[name] = _run(engine, tokens, targets, slice(dp_rank * local, (dp_rank + 1) * local))
    return results


def _reference(model: str, tokens, targets):
    from mtcore.backend import select_backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = _engine(model, ParallelLayout.single(), select_backend("cpu"))
        return _run(engine, tokens, targets, slice(None))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs():
    tokens, targets = _batches()
    ranks = run_ranks(_rank_main, WORLD, list(CASES), tokens, targets)
    refs = {model: _reference(model, tokens, targets) for model in MODELS}
    return ranks, refs


def _merged(ranks, name, key):
    """Rank 0's full dict, plus the other pipeline stages' entries (grads come per stage)."""
    out = {}
    for r in ranks:
        if r[name][key] is not None:
            out.update(r[name][key])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_one_process(runs, case):
    ranks, refs = runs
    ref = refs[CASES[case][0]]
    for rank, got in enumerate(r[case] for r in ranks):
        for step in range(STEPS):
            for key in ("loss", "norm"):
                err = abs(got[key][step] - ref[key][step]) / abs(ref[key][step])
                assert err <= RTOL, (
                    f"{case} rank {rank} step {step}: {key} {got[key][step]} vs {ref[key][step]}"
                )
            load = got["moe"][step]
            for key, want in ref["moe"][step].items():  # loads, dropped, aux and z losses
                assert abs(load[key] - want) <= RTOL * max(abs(want), 1.0), (case, rank, step, key)
    weights = ranks[0][case]["weights"]
    assert weights is not None and set(weights) == set(ref["weights"]), case
    for name, want in ref["weights"].items():
        err = rel_error(weights[name], want)
        assert err <= RTOL, f"{case}: {name} after {STEPS} steps: rel err {err:.2e}"
    assert all(r[case]["weights"] is None for r in ranks[1:]), "only rank 0 gathers the weights"
    if CASES[case][2]:
        return  # ZeRO-1 holds gradient shards; its weights and norms are checked above
    for rank, got in enumerate(r[case] for r in ranks):
        err = abs(got["plain_norm"] - ref["plain_norm"]) / ref["plain_norm"]
        assert err <= RTOL, (
            f"{case} rank {rank}: clip_grad_norm_ {got['plain_norm']} vs {ref['plain_norm']}"
        )
    grads = _merged(ranks, case, "grads")
    assert set(grads) == {n for n in ref["grads"]}, case
    for name, want in ref["grads"].items():
        err = rel_error(grads[name], want)
        assert err <= RTOL, f"{case}: gradient of {name} at step {STEPS}: rel err {err:.2e}"


def test_zero1_shards_expert_state_over_edp(runs):
    ranks, _ = runs
    for name in (n for n in CASES if CASES[n][2]):
        for r in ranks:
            state, params = r[f"{name}/sharded"]
            assert state * 2 <= params and state > 0, (name, state, params)


def test_reference_exercises_the_checked_paths(runs):
    """Clipping was active; the aux-free biases moved; experts saw uneven loads."""
    _, refs = runs
    assert min(min(ref["norm"]) for ref in refs.values()) > OPT.max_grad_norm
    bias = refs["ag"]["weights"]["layers.0.mlp.router.expert_bias"]
    assert bias.abs().max() > 0
    assert max(s["load_max"] for s in refs["a2a"]["moe"]) > 1.0
    assert min(s["dropped"] for s in refs["cap"]["moe"]) > 0.0
