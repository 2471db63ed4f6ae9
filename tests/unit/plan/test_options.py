"""Each planner option against a hand-computed case: ZeRO stages 2 and 3 (memory and
traffic), flash attention, communication overlap, the gradient reduction dtype, and the
first/last stage layer counts. One GPT-2-style model throughout (4h GELU MLP, tied
embeddings, no dropout), small enough to count by hand."""

from __future__ import annotations

import pytest

from mtcore.plan import Options, constants, load_hardware, plan, timing
from mtcore.plan.data_parallel import DpTraffic, exposed, traffic
from mtcore.plan.layouts import LayoutStringError, layout_overrides, parse_layout
from mtcore.plan.stage import Stage, microbatch_time, rank_blocks
from mtcore.training.config import TrainConfig

A100 = load_hardware("A100-80GB")
H, HEADS, LAYERS, SEQ, VOCAB = 1024, 16, 8, 1024, 32768
BLOCK = 12 * H * H  # q, k, v, o and a 4h MLP: the planner's block (biases and norms left out)
EMBED = VOCAB * H + SEQ * H  # tied word embedding and learned positions
EFF = constants.LINK_EFFICIENCY


def config(tp=1, pp=1, gb=16, mb=1, dtype="bf16", **parallel):
    return TrainConfig.model_validate(
        {
            "model": {
                "family": "gpt",
                "style": "gpt2",
                "hidden_size": H,
                "num_layers": LAYERS,
                "num_heads": HEADS,
                "seq_len": SEQ,
                "vocab_size": VOCAB,
                "dropout": 0.0,
            },
            "parallel": {"tp": tp, "pp": pp, **parallel},
            "precision": {"dtype": dtype},
            "training": {"global_batch_size": gb, "micro_batch_size": mb},
        }
    )


def test_zero_stages_shard_what_they_say():
    """bf16 on 8 data-parallel ranks: 18 bytes a parameter, 6 + 12/8 under ZeRO-1,
    2 + 16/8 under ZeRO-2, 18/8 under ZeRO-3."""
    params = LAYERS * BLOCK + EMBED
    for zero, per_param in ((0, 18), (1, 6 + 12 / 8), (2, 2 + 16 / 8), (3, 18 / 8)):
        result = plan(config(), 8, A100, Options(zero=zero))
        rank = result.ranks[0]
        assert rank.params == params
        assert rank.state == pytest.approx(per_param * params), zero
        assert result.assumed["zero"] == str(zero)
    # beyond ZeRO-1's peak: the gradient bucket being reduced, and under ZeRO-3 two
    # gathered units (the largest here is the embedding with its positions)
    bucket = 4 * min(config().parallel.bucket_size, params)
    one = plan(config(), 8, A100, Options(zero=1)).ranks[0].transient
    assert plan(config(), 8, A100, Options(zero=2)).ranks[0].transient == one + bucket
    three = plan(config(), 8, A100, Options(zero=3)).ranks[0].transient
    assert three == pytest.approx(one + bucket + 2 * 2 * EMBED)
    assert plan(config(), 8, A100, Options(zero=None)).assumed["zero"] == "0 (parallel.zero)"
    # the notes say what mtcore trains (0-3), not that 2 and 3 are the planner's alone
    for zero in (0, 1, 2, 3):
        notes = " ".join(plan(config(), 8, A100, Options(zero=zero)).notes)
        assert "ZeRO-0 or 1" not in notes
        assert ("parallel.zero 3 shards the blocks'" in notes) == (zero == 3), zero


def test_zero_traffic_by_hand():
    """8 ranks in one A100 node (NVLink 300 GB/s, 3 us): each collective a ring."""
    spec, _ = config().check(8)
    params, unit = 1e9, 1e8

    def ring(nbytes):  # an all-gather / reduce-scatter of nbytes over 8 ranks
        return nbytes * 7 / 8 / (300e9 * EFF) + 7 * 3e-6

    bucket = 4 * 40_000_000
    zero0 = traffic(params, 0, unit, spec, A100, 2, 4, 40_000_000, 0)
    assert zero0.per_step_reduce == pytest.approx(2 * ring(4 * params))  # all-reduce: 2 rings
    assert zero0.last_bucket == pytest.approx(2 * ring(bucket))
    zero1 = traffic(params, 0, unit, spec, A100, 2, 4, 40_000_000, 1)
    assert zero1.per_step_reduce == pytest.approx(ring(4 * params))
    assert zero1.after_step_gather == pytest.approx(ring(2 * params))
    zero2 = traffic(params, 0, unit, spec, A100, 2, 4, 40_000_000, 2)
    assert zero2.per_step_reduce == 0 and zero2.per_microbatch_reduce == pytest.approx(
        ring(4 * params)
    )
    assert zero2.after_step_gather == pytest.approx(ring(2 * params))
    zero3 = traffic(params, 0, unit, spec, A100, 2, 4, 40_000_000, 3)
    assert zero3.per_microbatch_gather == pytest.approx(ring(2 * params))
    assert zero3.after_step_gather == 0 and zero3.first_unit == pytest.approx(ring(2 * unit))
    # two micro-batches: two reduce-scatters, and under ZeRO-3 four gathers
    assert zero3.total(2, 3) == pytest.approx(2 * ring(4 * params) + 4 * ring(2 * params))


def test_zero_overlap_by_hand():
    t = DpTraffic(
        per_step_reduce=0.0,
        per_microbatch_reduce=1.5,
        per_microbatch_gather=1.0,
        after_step_gather=0.0,
        last_bucket=0.1,
        first_unit=0.05,
    )
    forward, backward = 0.4, 0.8
    # each micro-batch: gather + reduce behind its backward, a gather behind its forward
    assert exposed(t, 3, "full", 1, 2, forward, backward) == pytest.approx(
        2 * ((1.5 + 1.0 - 0.8) + (1.0 - 0.4))
    )
    assert exposed(t, 3, "mtcore", 1, 2, forward, backward) == exposed(
        t, 3, "full", 1, 2, forward, backward
    )
    assert exposed(t, 3, "none", 1, 2, forward, backward) == pytest.approx(2 * (1.5 + 2 * 1.0))
    fast = DpTraffic(0.0, 0.01, 0.01, 0.0, 0.1, 0.05)  # hidden but for what nothing hides
    assert exposed(fast, 3, "full", 4, 3, forward, backward) == pytest.approx(3 * (0.1 + 0.05))
    two = DpTraffic(0.0, 1.5, 0.0, 0.3, 0.1, 0.0)
    assert exposed(two, 2, "full", 1, 2, forward, backward) == pytest.approx(2 * 0.7 + 0.0)


def test_flash_attention_by_hand():
    """No flash: the score matrix (bf16, no dropout) is kept, 2 a s^2 b bytes a layer,
    where flash keeps a log-sum-exp, 4 a s b; its backward recomputes Q K^T (half the
    score products' forward)."""
    on = plan(config(), 8, A100, Options(fused_attention=True))
    off = plan(config(), 8, A100, Options(fused_attention=False))
    per_layer = 2 * HEADS * SEQ * SEQ - 4 * HEADS * SEQ
    assert off.ranks[0].activations - on.ranks[0].activations == pytest.approx(LAYERS * per_layer)
    scores = 4 * SEQ * SEQ * H  # Q K^T and A V of one sequence, forward
    rate = timing.gemm_flops(A100, A100.peak_flops("bf16"))
    microbatches = 2
    assert on.time.compute - off.time.compute == pytest.approx(
        microbatches * LAYERS * 0.5 * scores / rate
    )
    assert on.assumed["flash attention"] == "on" and off.assumed["flash attention"] == "off"
    assert plan(config(), 8, A100).assumed["flash attention"] == "on (A100-80GB file)"


def test_communication_overlap_by_hand():
    """tp's all-reduces behind the micro-batch's compute: only what exceeds it stays."""
    base = plan(config(tp=8, gb=8), 8, A100)
    hidden = plan(config(tp=8, gb=8), 8, A100, Options(overlapped=("tp",)))
    m = base.microbatches
    tp_one, busy = base.time.tp_comm / m, (base.time.compute + base.time.recompute) / m
    assert hidden.time.tp_comm == pytest.approx(m * max(0.0, tp_one - busy))
    assert hidden.time.total < base.time.total
    assert hidden.assumed["comm overlap"] == "tp" and base.assumed["comm overlap"] == "none"


def test_gradient_reduction_dtype_by_hand():
    """bf16 gradient buffers: half the bytes held and half the bytes all-reduced."""
    fp32 = plan(config(gb=8), 8, A100, Options(dp_overlap="none"))
    bf16 = plan(config(gb=8), 8, A100, Options(dp_overlap="none", grad_reduce_dtype="bf16"))
    params = fp32.ranks[0].params
    assert fp32.ranks[0].grads == 4 * params and bf16.ranks[0].grads == 2 * params
    ring = 2 * (2 * params) * 7 / 8 / (300e9 * EFF) + 2 * 7 * 3e-6  # all-reduce of 2P bytes
    assert bf16.time.dp_comm == pytest.approx(ring)
    assert bf16.assumed["grad reduce dtype"] == "bf16"


def test_first_and_last_stage_layers_by_hand():
    """8 layers on pp = 2 as 3 + 5: the first stage holds 3 blocks and the embedding, the
    last 5 blocks and the tied copy; the pipeline fills and drains through the lighter
    stage once, so the step is m t_slow + t_light."""
    uneven = config(pp=2, gb=8, first_stage_layers=3)
    result = plan(uneven, 2, A100)
    assert [r.params for r in result.ranks] == [3 * BLOCK + EMBED, 5 * BLOCK + EMBED]
    assert result.assumed["stage layers"] == "3 / 5"
    spec, m = uneven.check(2)
    shape_counts = [3, 5]
    from mtcore.plan import model_shape

    shape = model_shape(uneven.model)
    times = []
    for rank in range(2):
        stage = Stage(rank_blocks(shape, shape_counts, 2, 1, rank), rank == 0, rank == 1)
        products = timing.Products(A100, "bf16")
        times.append(
            sum(microbatch_time(shape, stage, 1, spec, A100, "none", True, 2, products).values())
        )
    assert result.time.bubble == pytest.approx(min(times))
    # the tied word embedding's fp32 gradient summed over its two copies (one node, NVLink)
    embedding = 4 * VOCAB * H
    assert result.time.tied_comm == pytest.approx(2 * embedding / 2 / (300e9 * EFF) + 2 * 3e-6)
    t = result.time
    busy = t.total - t.bubble - t.dp_exposed - t.tied_comm - t.optimizer
    assert busy == pytest.approx(m * max(times))
    # Llama 3 405B's split: 126 layers on 16 stages, one fewer on the first and last
    llama = config(pp=16, gb=16)
    llama = llama.model_copy(
        update={
            "model": llama.model.model_copy(update={"num_layers": 126}),
            "parallel": llama.parallel.model_copy(
                update={"first_stage_layers": 7, "last_stage_layers": 7}
            ),
        }
    )
    result = plan(llama, 16, A100)
    assert [r.params for r in result.ranks] == [7 * BLOCK + EMBED] + [8 * BLOCK] * 14 + [
        7 * BLOCK + EMBED
    ]
    assert result.assumed["stage layers"] == "7 / 8 x 14 / 7"


def test_layout_strings_carry_planner_options_and_sweep_refuses_them():
    overrides, options = parse_layout("tp=2,first=3,zero=3,flash=off,overlap=tp+pp,cross_node")
    assert overrides == ["--parallel.tp", "2", "--parallel.first_stage_layers", "3"]
    assert options == {
        "zero": 3,
        "fused_attention": False,
        "overlapped": ("tp", "pp"),
        "cross_node": True,
    }
    assert parse_layout("grad_dtype=bf16,dp_overlap=full")[1] == {
        "grad_reduce_dtype": "bf16",
        "dp_overlap": "full",
    }
    with pytest.raises(LayoutStringError, match="zero is a planner assumption"):
        layout_overrides("tp=2,zero=3")
    # stages 0-2 are trained: a config override (and the column's planner assumption)
    assert parse_layout("tp=2,zero=2") == (
        ["--parallel.tp", "2", "--parallel.zero", "2"],
        {"zero": 2},
    )
    assert layout_overrides("zero=2,tp=2") == ["--parallel.zero", "2", "--parallel.tp", "2"]
    assert layout_overrides("tp=2,last=1") == [
        "--parallel.tp",
        "2",
        "--parallel.last_stage_layers",
        "1",
    ]
