"""The MoE layer under expert (and expert-tensor) parallelism equals one process.

One 4-rank gloo spawn runs every layout: ep=4 (dp=4), ep=2 (dp=4: two expert
groups), ep=2 x tp=2 with and without sequence parallel; each with both
dispatchers (all-to-all, its deduplicating variant, all-gather), dropless and
with a capacity factor.

What equals what. Data-parallel rank ``d`` feeds micro-batch ``d`` (its tp
ranks share it; under SP each holds a sequence shard). The reference is one
process (ep=tp=1, same generator) that runs every micro-batch in turn and
accumulates gradients of ``sum_d <y_d, g_d> + aux/z losses of each micro-batch``
(the balancing loss belongs to one micro-batch, so it is the same in both).
Then, on each rank:

* output and input grad = the reference's for that micro-batch (our shard);
* router and shared-expert grads (dense, each rank saw only its micro-batch):
  summed over tp under SP (``allreduce_sequence_parallel_grads``), unsharded
  over tp, summed over dp = the reference's accumulated grad;
* expert grads: an expert's grad already sums the micro-batches of its ep
  group (their tokens came to it), so summed over the expert-data-parallel
  group (``edp``), unsharded over tp and gathered over ep = the reference's.

With a capacity factor the kept (token, choice) pairs must be identical.
Tolerance: fp32, relative error 1e-5. Without a spawn: the router losses' cp
rule (counts of the whole micro-batch, this share's scores) against one process.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.parallel.moe import (
    MoELayer,
    MoESpec,
    ep_group,
    full_expert_tensor,
    named_expert_parameters,
)
from mtcore.parallel.tensor import (
    TPGroup,
    allreduce_sequence_parallel_grads,
    full_tensor,
    named_tp_parameters,
)
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

RTOL = 1e-5
DISPATCHERS = ("alltoall", "alltoall_dedup", "allgather")
HIDDEN, BATCH, SEQ = 16, 2, 8
LAYOUTS = {
    "ep4": LayoutSpec(ep=4),
    "ep2_dp4": LayoutSpec(ep=2),
    "ep2_tp2": LayoutSpec(ep=2, tp=2),
    "ep2_tp2_sp": LayoutSpec(ep=2, tp=2, sequence_parallel=True),
}
SLOW_LAYOUTS = {  # 8 ranks: run with -m slow
    "ep4_tp2_sp": LayoutSpec(ep=4, tp=2, sequence_parallel=True),
    "ep2_dp4_tp2": LayoutSpec(ep=2, tp=2),
    "ep8": LayoutSpec(ep=8),
}
SPECS = {  # each runs with every dispatcher; variants spread over router options
    "dropless": dict(
        num_experts=8,
        top_k=2,
        ffn_size=8,
        z_loss_coeff=1e-2,
        aux_loss_coeff=0.1,
        bias_update_rate=0.05,
    ),
    "sigmoid_seq_shared": dict(
        num_experts=8,
        top_k=3,
        ffn_size=8,
        score="sigmoid",
        aux_loss="seq",
        aux_loss_coeff=0.1,
        shared_ffn_size=8,
        activation="gelu",
    ),
    # a bias that sends every token to experts 0 and 1: other ranks get no rows at all
    "all_to_rank0": dict(num_experts=8, top_k=2, ffn_size=8, bias_update_rate=10.0),
    # 4 experts: one per rank at ep=4
    "capacity": dict(
        num_experts=4, top_k=2, ffn_size=8, capacity_factor=0.75, topk_then_softmax=True
    ),
}


def _data(micro_batches: int):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(micro_batches, BATCH, SEQ, HIDDEN, generator=g)
    grad = torch.randn(micro_batches, BATCH, SEQ, HIDDEN, generator=g)
    return x, grad


def _build(spec, layout, backend, tp, sp):
    layer = MoELayer(
        HIDDEN,
        spec,
        tp=tp,
        layout=layout,
        backend=backend,
        sequence_parallel=sp,
        generator=torch.Generator().manual_seed(5),
        init_std=0.3,
        out_std=0.2,
        bias=True,
    )
    # aux-loss-free balancing: a bias that changes some choices, the same on every rank
    load = [0, 0, 9, 9, 9, 9, 9, 9] if spec.bias_update_rate > 1 else [9, 0, 4, 4, 4, 0, 9, 2]
    layer.update_expert_bias(torch.tensor(load))
    return layer


def _reference(spec, backend, x, grad):
    """One process, every micro-batch in turn: outputs, input grads, keeps, summed param grads."""
    layer = _build(spec, ParallelLayout.single(), backend, TPGroup.single(backend), False)
    outs, gins, keeps, counts, dropped = [], [], [], [], 0
    for xi, gi in zip(x, grad, strict=True):
        xi = xi.clone().requires_grad_(True)
        y = layer(xi)
        (y * gi).sum().backward()
        outs.append(y.detach())
        gins.append(xi.grad)
        keeps.append(layer.last_keep)
        stats = layer.pop_stats()
        counts.append(stats.tokens_per_expert)
        dropped += stats.dropped
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return outs, gins, keeps, grads, counts, dropped


def _full_grads(layer, layout, backend, tp):
    """Every parameter's grad as the reference holds it (see the module docstring)."""
    allreduce_sequence_parallel_grads(layer, tp)
    collective = backend.collective
    experts = {name: dim for name, _, (dim, _) in named_expert_parameters(layer)}
    out = {}
    for name, p, partition, _ in named_tp_parameters(layer):
        g = p.grad.clone()
        if name in experts:
            collective.all_reduce(g, group=layout.edp.group)
            g = full_expert_tensor(g, tp, ep_group(layout, backend), partition)
        else:
            g = full_tensor(g, tp, partition)
            collective.all_reduce(g, group=layout.group(Axis.DP))
        out[name] = g
    return out


def _check_layout(ctx, name, layout_spec):
    backend = ctx.backend
    layout = ParallelLayout.build(layout_spec, backend.collective, ctx.rank, ctx.world_size)
    tp = TPGroup.from_layout(layout, backend)
    sp = layout_spec.sequence_parallel
    x, grad = _data(layout.dp)
    d = layout.dp_rank
    shard = slice(tp.rank * SEQ // tp.size, (tp.rank + 1) * SEQ // tp.size) if sp else slice(None)
    results = {}
    for spec_name, kwargs in SPECS.items():
        if kwargs["num_experts"] % layout.ep:
            continue  # (the 4-expert spec at ep=8)
        # one process has no ep group: every dispatcher does the same there
        ref_out, ref_gin, ref_keep, ref_grads, ref_counts, ref_dropped = _reference(
            MoESpec(**kwargs), backend, x, grad
        )
        for dispatcher in DISPATCHERS:
            spec = MoESpec(**kwargs, dispatcher=dispatcher)
            layer = _build(spec, layout, backend, tp, sp)
            xi = x[d][:, shard].clone().requires_grad_(True)
            y = layer(xi)
            (y * grad[d][:, shard]).sum().backward()
            grads = _full_grads(layer, layout, backend, tp)
            keep_same = True
            if spec.capacity_factor is not None:
                keep_same = bool(torch.equal(layer.last_keep, ref_keep[d]))
            stats = layer.pop_stats()
            results[f"{name}/{spec_name}/{dispatcher}"] = {
                "out": rel_error(y.detach(), ref_out[d][:, shard]),
                "grad_in": rel_error(xi.grad, ref_gin[d][:, shard]),
                "grads": max((rel_error(grads[k], ref_grads[k]), k) for k in ref_grads),
                "names": sorted(grads) == sorted(ref_grads),
                "keep_same": keep_same,
                "dropped_some": ref_dropped > 0 if spec.capacity_factor else True,
                "tokens_per_expert": torch.equal(stats.tokens_per_expert, ref_counts[d]),
            }
    return results


def _all_layouts(ctx, layouts):
    out = {}
    for name, layout_spec in layouts.items():
        out.update(_check_layout(ctx, name, layout_spec))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_layouts, 4, LAYOUTS)


def _cases(layouts):
    return [f"{lay}/{spec}/{disp}" for lay in layouts for spec in SPECS for disp in DISPATCHERS]


CASES = _cases(LAYOUTS)


@pytest.mark.parametrize("case", CASES)
def test_layer_matches_one_process(results, case):
    _assert_matches(results, case)


def _assert_matches(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["names"], f"rank {rank}: parameter names differ from the reference"
        assert r["out"] <= RTOL, f"rank {rank} output rel error {r['out']:.2e}"
        assert r["grad_in"] <= RTOL, f"rank {rank} input grad rel error {r['grad_in']:.2e}"
        err, name = r["grads"]
        assert err <= RTOL, f"rank {rank} grad of {name} rel error {err:.2e}"
        assert r["tokens_per_expert"], f"rank {rank}: load statistics differ"


@pytest.mark.parametrize("case", [c for c in CASES if "/capacity/" in c])
def test_capacity_drops_the_same_tokens(results, case):
    for rank, res in enumerate(results):
        assert res[case]["dropped_some"], "the capacity case must actually drop tokens"
        assert res[case]["keep_same"], f"rank {rank}: kept assignments differ from one process"


@pytest.mark.slow
def test_eight_ranks_match_one_process():
    """ep=4 x tp=2 with SP, ep=2 x dp=4 x tp=2 and ep=8: the same checks on 8 ranks."""
    results = run_ranks(_all_layouts, 8, SLOW_LAYOUTS)
    cases = [c for c in _cases(SLOW_LAYOUTS) if c in results[0]]
    assert len(cases) == len(_cases(SLOW_LAYOUTS)) - len(DISPATCHERS)  # capacity skips ep8
    for case in cases:
        _assert_matches(results, case)
        for res in results:
            assert res[case]["keep_same"], case


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("aux", ["batch", "seq"])
def test_cp_contributions_of_the_router_losses_add_up_to_one_process(aux, cp):
    """What the layer does per cp rank (counts summed over cp, its own scores): the
    contributions' mean is the one-process loss and their gradients, summed, are cp
    times one process's (the factor the main loss's gradient carries on a cp rank)."""
    from mtcore.parallel.context.group import local_positions
    from mtcore.parallel.moe.router import (
        load_balancing_loss,
        route,
        sequence_load_balancing_loss,
        sequence_tokens_per_expert,
        tokens_per_expert,
        z_loss,
    )

    b, s, e = 3, 16, 6
    spec = MoESpec(num_experts=e, top_k=2, ffn_size=8, score="sigmoid", aux_loss=aux)
    full = torch.randn(b, s, e, generator=torch.Generator().manual_seed(3))  # routing is fp32

    def losses(logits, counts=None):
        r = route(logits.reshape(-1, e), spec)
        if aux == "seq":
            lb = sequence_load_balancing_loss(r.scores, r.experts, e, b, counts)
        else:
            lb = load_balancing_loss(r.scores, r.experts, e, counts)
        return lb, z_loss(logits.reshape(-1, e)), r.experts

    ref = full.clone().requires_grad_()
    want_lb, want_z, _ = losses(ref)
    want_grad = torch.autograd.grad(want_lb + want_z, ref)[0]

    shares = [full[:, local_positions(s, cp, r)].clone().requires_grad_() for r in range(cp)]
    count = sequence_tokens_per_expert if aux == "seq" else tokens_per_expert
    args = (b,) if aux == "seq" else ()
    whole = sum(count(losses(x)[2], e, *args) for x in shares)  # the all-reduce over cp
    got_lb, got_z, got_grad = 0.0, 0.0, torch.zeros_like(full)
    for r, x in enumerate(shares):
        lb, z, _ = losses(x, whole)
        got_lb, got_z = got_lb + lb.item() / cp, got_z + z.item() / cp
        got_grad[:, local_positions(s, cp, r)] = torch.autograd.grad(lb + z, x)[0]
    assert got_lb == pytest.approx(want_lb.item(), rel=1e-6)
    assert got_z == pytest.approx(want_z.item(), rel=1e-6)
    torch.testing.assert_close(got_grad, cp * want_grad, rtol=1e-5, atol=1e-7)
    # Without the whole micro-batch's counts a rank's loss is another function.
    local = sum(losses(x)[0].item() for x in shares) / cp
    assert local != pytest.approx(want_lb.item(), rel=1e-4)
