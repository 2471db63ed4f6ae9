"""Per-rank memory against the closed forms: 6 + 12/d (ZeRO-1) or 18 bytes per parameter
for weights and optimizer state, and Korthikanti et al. 2022's activation formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from published import MEGATRON_CORE_2024, NARAYANAN_2021, megatron_core_config, narayanan_config

from mtcore.parallel.pipeline import build_schedule
from mtcore.parallel.pipeline.schedules import BACKWARD, FORWARD
from mtcore.plan import Options, load_hardware, plan
from mtcore.plan.layouts import layout_overrides
from mtcore.plan.memory import (
    backward_transient_bytes,
    head_saved_bytes,
    head_transient_bytes,
    heads_in_flight,
    in_flight,
    layer_activation_bytes,
)
from mtcore.plan.shapes import Block
from mtcore.training.overrides import load_config

ROWS = [("narayanan", r) for r in NARAYANAN_2021] + [
    ("megatron-core", r) for r in MEGATRON_CORE_2024
]


def _config(source, row, zero1):
    _, hidden, layers, heads, tp, pp, gpus, batch, _ = row
    make = narayanan_config if source == "narayanan" else megatron_core_config
    config = make(hidden, layers, heads, tp, pp, gpus, batch)
    parallel = config.parallel.model_copy(update={"zero1": zero1})
    precision = config.precision.model_copy(update={"dtype": "bf16"})
    return config.model_copy(update={"parallel": parallel, "precision": precision}), gpus


@pytest.mark.parametrize("zero1", [False, True], ids=["no-zero", "zero1"])
@pytest.mark.parametrize("source,row", ROWS, ids=[f"{s}-{r[0]}" for s, r in ROWS])
def test_weights_and_optimizer_bytes_per_parameter(source, row, zero1):
    config, gpus = _config(source, row, zero1)
    result = plan(config, gpus, load_hardware("H100-SXM"), Options())
    d = result.layout["dp"]
    expected = 6 + 12 / d if zero1 else 18
    for rank in result.ranks:
        assert rank.state / rank.params == pytest.approx(expected, rel=0.05)


GPT3 = dict(gated=False, dropout=True)


def _block(h, a, s):
    return Block(seq=s, kv_seq=s, hidden=h, heads=a, kv_heads=a, head_dim=h // a, ffn=4 * h, **GPT3)


# (hidden, heads, seq, micro-batch, tp) from Table 1's 18.4B, 145.6B and 1T rows
SHAPES = [
    (6144, 48, 2048, 1, 8),
    (12288, 96, 2048, 2, 8),
    (25600, 160, 2048, 1, 8),
    (2304, 24, 2048, 4, 1),
]


@pytest.mark.parametrize("h,a,s,b,t", SHAPES)
def test_korthikanti_2022_activation_formulas(h, a, s, b, t):
    block = _block(h, a, s)
    sbh, scores = s * b * h, 5 * a * s / (h * t)
    cases = {
        ("none", False): sbh * (10 + 24 / t + scores),
        ("none", True): sbh * (34 / t + scores),
        ("selective", False): sbh * (10 + 24 / t),
        ("selective", True): sbh * (34 / t),
        ("full", False): 2 * sbh,
        ("full", True): 2 * sbh / t,
    }
    for (recompute, sp), formula in cases.items():
        if sp and t == 1:
            continue
        got = layer_activation_bytes(
            block, b, t, 1, sp, recompute, fused_attention=False, act_bytes=2
        )
        assert got == pytest.approx(formula, rel=0.10), (recompute, sp)


def test_first_stage_holds_p_microbatches_under_1f1b():
    """Korthikanti et al. sec. 4.2.3: stage 0 of 1F1B holds L/p layers for p micro-batches,
    i.e. every layer's activations once; interleaving adds a factor 1 + (p-1)/(p v)."""
    assert in_flight("1f1b", 8, 1, 0, 64) == 8
    assert in_flight("1f1b", 8, 1, 7, 64) == 1
    assert in_flight("1f1b", 8, 1, 0, 3) == 3  # fewer micro-batches than stages
    assert in_flight("1f1b", 8, 4, 0, 64) == pytest.approx(8 * (1 + 7 / (8 * 4)))
    assert in_flight("gpipe", 4, 1, 0, 16) == 16
    _, hidden, layers, heads, tp, pp, gpus, batch, _ = NARAYANAN_2021[2]  # 76.1B, pp 4
    config = narayanan_config(hidden, layers, heads, tp, pp, gpus, batch)
    result = plan(config, gpus, load_hardware("A100-80GB"), Options())
    per_layer = 2 * 2048 * 1 * hidden  # full recompute keeps each layer's input
    assert result.ranks[0].activations == pytest.approx(layers * per_layer, rel=0.10)


def test_a_gated_mlp_keeps_four_intermediates_and_a_gelu_one_two():
    """mtcore's swiglu is silu(gate) * up: fc1's and fc3's outputs, silu(fc1) and the
    product stay for backward (what the sweep's tensor peaks showed on the host); a GELU
    MLP keeps its input and output (Korthikanti's 16 s b h for a 4h MLP in 2 bytes)."""
    s, b, h, f = 256, 1, 512, 1408
    common = dict(seq=s, kv_seq=s, hidden=h, heads=8, kv_heads=8, head_dim=64, dropout=False)
    gated, gelu = Block(ffn=f, gated=True, **common), Block(ffn=f, gated=False, **common)
    difference = layer_activation_bytes(gated, b, 1, act_bytes=4) - layer_activation_bytes(
        gelu, b, 1, act_bytes=4
    )
    assert difference == 4 * s * b * f * 2  # two more ffn-wide tensors of 4 bytes


def test_the_backward_transient_is_the_first_weight_gradient_and_its_input_gradient():
    s, b, h, f, v = 256, 2, 512, 1408, 4096
    block = Block(seq=s, kv_seq=s, hidden=h, heads=8, kv_heads=2, head_dim=64, ffn=f,
                  gated=True, dropout=False)  # fmt: skip
    # fc2's weight gradient (h x f / tp) and its input's (s b f / tp), in fp32
    assert backward_transient_bytes(block, b, 2, 1, act_bytes=4) == 4 * (h * f / 2 + s * b * f / 2)
    received = backward_transient_bytes(block, b, 2, 1, act_bytes=4, received=True)
    assert received - backward_transient_bytes(block, b, 2, 1, act_bytes=4) == 4 * s * b * h
    # the head: the backward (softmax as the logits' gradient, the output weight's
    # gradient, the head input's gradient) outweighs the forward (logits and softmax)
    tokens = s * b
    norm = 2 * 4 * tokens * h
    backward = 4 * tokens * v / 2 + 4 * v / 2 * h + 4 * tokens * h
    assert head_transient_bytes(tokens, h, v, 2, False, 4) == norm + backward
    # long sequences of a small head: the forward's logits and softmax are the larger
    long = 64 * tokens
    assert head_transient_bytes(long, h, v, 2, False, 4) == 2 * 4 * long * h + long * v / 2 * 8


class _OneRank:
    """The identity collective: the vocab-parallel loss runs its per-rank code at one rank."""

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return None

    def all_gather(self, output, input, group=None, async_op=False):
        output.copy_(input.reshape(output.shape))
        return SimpleNamespace(wait=lambda: None) if async_op else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_transients_are_what_the_vocab_parallel_loss_allocates(dtype):
    """One rank's shard of the vocab-parallel loss, its allocations measured per logit
    (torch profiler, as ``mtcore sweep`` measures) and put into the formula: the forward
    holds the logits and allocates the exps it keeps (4 bytes), plus, for bf16, the
    logits widened to fp32 (4 more); the backward turns the exps into the gradient in
    place and, for bf16, narrows it back (2 more)."""
    from mtcore.parallel.tensor import TPGroup
    from mtcore.parallel.tensor.cross_entropy import _VocabParallelCrossEntropy
    from mtcore.plan.sweep import tensor_peak

    tokens, shard, h = 1024, 2048, 8
    tp = TPGroup(SimpleNamespace(collective=_OneRank()), None, 1, 0)
    logits = torch.randn(tokens, shard, dtype=dtype, requires_grad=True)
    target = torch.randint(0, shard, (tokens,))
    with tensor_peak() as forward:
        loss = _VocabParallelCrossEntropy.apply(logits, target, tp, -100)
    with tensor_peak() as backward:
        loss.sum().backward()
    e, count = logits.element_size(), tokens * shard
    forward_new, backward_new = forward[0] / count, backward[0] / count
    assert forward_new == pytest.approx(8 if e < 4 else 4, rel=0.01)
    assert backward_new == pytest.approx(2 if e < 4 else 0, abs=0.05)  # + per-row vectors
    norm = 2 * e * tokens * h
    phases = max((e + forward_new) * count, (4 + backward_new) * count + e * tokens * h)
    modelled = head_transient_bytes(tokens, h, 2 * shard, 2, False, e, trains_head=False)
    assert modelled == pytest.approx(norm + phases, rel=0.01)


def _heads_held(schedule) -> int:
    """Most last-stage loss forwards whose backward has not run, walking the last rank's
    compute order (the last chunk is the one that computes the loss)."""
    held = most = 0
    for a in schedule.compute_order(schedule.pp - 1):
        if a.chunk == schedule.vpp - 1:
            held += 1 if a.kind == FORWARD else -1 if a.kind == BACKWARD else 0
            most = max(most, held)
    return most


@pytest.mark.parametrize("name,vpps", [("1f1b", (1,)), ("gpipe", (1,)), ("1f1b", (2, 3, 4))])
def test_in_flight_counts_what_the_trainers_schedules_hold(name, vpps):
    """The closed forms against the action lists the trainer runs, every rank, including
    as many micro-batches as stages, where interleaving runs every forward first."""
    for pp in (2, 3, 4, 8):
        for vpp in vpps:
            for m in range(1, 3 * pp + 1):
                if vpp > 1 and m % pp:
                    continue  # interleaving needs a multiple of pp
                schedule = build_schedule(name, pp, m, vpp)
                for rank in range(pp):
                    held = schedule.max_in_flight(rank) / vpp
                    assert in_flight(name, pp, vpp, rank, m) == held, (name, pp, vpp, m, rank)
                assert heads_in_flight(name, pp, vpp, m) == _heads_held(schedule), (pp, vpp, m)
    assert heads_in_flight("1f1b", 2, 2, 2) == 2  # the default config's tp1 x pp2 x vpp2
    assert heads_in_flight("1f1b", 2, 2, 4) == 1
    assert heads_in_flight("gpipe", 1, 1, 4) == 1  # one stage: no pipelining


def test_the_unsharded_loss_backward_holds_three_logit_sized_fp32_buffers():
    """At tp=1 the log-softmax's saved output, the NLL's gradient of it and the logits'
    gradient are alive at once (what the sweep's live blocks showed at the peak)."""
    tokens, h, v = 512, 128, 4096
    norm = 2 * 4 * tokens * h
    assert head_transient_bytes(tokens, h, v, 1, False, 4) == norm + 3 * 4 * tokens * v
    # a wide head on few tokens: the output weight's gradient phase is the larger
    few = 8
    phase = 4 * few * v + 4 * v * h + 4 * few * h
    assert head_transient_bytes(few, h, v, 1, False, 4) == 2 * 4 * few * h + phase
    assert head_saved_bytes(tokens, h, v, 2, False, 4) == norm + 4 * tokens * v / 2


def test_the_last_stage_keeps_every_head_when_interleaving_runs_all_forwards_first():
    """configs/default.yaml as tp1 x pp2 x vpp2 on 4 ranks: dp 2 leaves 2 micro-batches per
    rank, as many as stages, so the last stage holds both micro-batches' chunks and both
    losses' saved buffers at its first backward (issue 21: 74 MB measured)."""
    config = load_config("configs/default.yaml", layout_overrides("tp=1,pp=2,vpp=2"))
    result = plan(config, 4, load_hardware("cpu-host"), Options(fused_attention=True))
    assert result.microbatches == 2
    last = result.ranks[1]
    assert last.in_flight == 2 == result.ranks[0].in_flight
    tokens, h, v = 4 * 128, 128, 4096
    one = head_transient_bytes(tokens, h, v, 1, False, 4)
    assert last.transient == one + head_saved_bytes(tokens, h, v, 1, False, 4)
    assert 65e6 < last.peak < 75e6
