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

from mtcore.models.gpt import GPTConfig
from mtcore.parallel.clip import clip_grad_norm_
from mtcore.parallel.tensor import full_tensor, named_tp_parameters
from mtcore.testing.compare import rel_error
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig
from mtcore.training.moe import gather_experts

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
    f"{layout}_{model}": Case(WORLD, model, *LAYOUTS[layout])
    for layout in LAYOUTS
    for model in ("a2a", "ag")
    if not (layout == "ep2_tp2_sp" and model == "ag")  # SP once is enough
}
CASES["ep4_cap"] = Case(WORLD, "cap", *LAYOUTS["ep4"])  # capacity 1.0: the same tokens dropped
CASES["ep2_tp2_dedup"] = Case(WORLD, "dedup", *LAYOUTS["ep2_tp2"])  # the third dispatcher
# Only layer 0 is MoE: with interleaving, pipeline rank 1 (layers 1 and 3) has no experts.
CASES["ep2_pp2_vpp2_first"] = Case(WORLD, "first", dict(ep=2, pp=2, vpp=2))


def _full_grads(engine) -> dict | None:
    """The last step's reduced (clipped) gradients, whole, on dp index 0 / tp rank 0."""
    if engine.optimizer.sharded or engine.layout.edp.rank != 0:
        return None
    out = {}
    for chunk in engine.chunks:
        grads = {
            name: full_tensor(p.main_grad, chunk.tp, partition)
            for name, p, partition, _ in named_tp_parameters(chunk)
        }
        gather_experts(chunk, grads, engine.layout, engine.collective)
        out.update(grads)
    lead = engine.layout.tp_rank == 0 and engine.layout.dp_cp.rank == 0
    return out if lead else None


def _moe_records(engine, record: dict) -> None:
    """The last step's whole gradients (experts gathered), ``clip_grad_norm_`` (gradients
    held whole) on them, and under ZeRO-1 the expert state against the expert params."""
    record["grads"] = _full_grads(engine)
    record["plain_norm"] = None
    if not engine.optimizer.sharded:
        params = [p for chunk in engine.chunks for p in chunk.parameters()]
        record["plain_norm"] = clip_grad_norm_(params, 1e30, engine.layout, engine.collective)
    else:  # expert state is sharded over edp: half of the experts' elements per rank
        expert_state = sum(
            s.numel for s in engine.optimizer.segments if s.buffer.reduce_group == "edp"
        )
        expert_params = sum(b.numel for b in engine.ddp.grad_buffers if b.reduce_group == "edp")
        record["sharded"] = (expert_state, expert_params)


SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False, evaluate=False,
              probe=_moe_records)  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64))


def _merged(ranks, key):
    """Rank 0's full dict, plus the other pipeline stages' entries (grads come per stage)."""
    out = {}
    for r in ranks:
        if r[key] is not None:
            out.update(r[key])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_one_process(runs, case):
    ranks, ref = runs[case]
    # loads, dropped tokens, aux and z losses: relative to max(|value|, 1)
    assert_matches(SETUP, case, CASES[case], ranks, ref, moe_floor=1.0)
    if CASES[case].zero1:
        return  # ZeRO-1 holds gradient shards; its weights and norms are checked above
    for rank, got in enumerate(ranks):
        err = abs(got["plain_norm"] - ref["plain_norm"]) / ref["plain_norm"]
        assert err <= SETUP.rtol, (
            f"{case} rank {rank}: clip_grad_norm_ {got['plain_norm']} vs {ref['plain_norm']}"
        )
    grads = _merged(ranks, "grads")
    assert set(grads) == set(ref["grads"]), case
    for name, want in ref["grads"].items():
        err = rel_error(grads[name], want)
        assert err <= SETUP.rtol, f"{case}: gradient of {name} at step {STEPS}: rel err {err:.2e}"


def test_zero1_shards_expert_state_over_edp(runs):
    for name in (n for n in CASES if CASES[n].zero1):
        for got in runs[name][0]:
            state, params = got["sharded"]
            assert state * 2 <= params and state > 0, (name, state, params)


def test_reference_exercises_the_checked_paths(runs):
    """Clipping was active; the aux-free biases moved; experts saw uneven loads."""
    refs = {CASES[name].model: runs[name][1] for name in CASES}
    assert min(min(ref["norm"]) for ref in refs.values()) > OPT.max_grad_norm
    bias = refs["ag"]["weights"]["layers.0.mlp.router.expert_bias"]
    assert bias.abs().max() > 0
    assert max(s["load_max"] for s in refs["a2a"]["moe"]) > 1.0
    assert min(s["dropped"] for s in refs["cap"]["moe"]) > 0.0
