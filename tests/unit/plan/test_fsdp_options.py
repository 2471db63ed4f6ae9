"""FSDP's switches under ZeRO-3 (issue 46.3), against hand counts: resharding after
forward on/off, the gradients reduced every micro-batch or once a step, the prefetch
depth. The traffic and its overlap on a synthetic step; the memory on test_options.py's
GPT-2-style model on 8 A100s of one node."""

from __future__ import annotations

import pytest
from test_options import BLOCK, EMBED, LAYERS, config

from mtcore.plan import Options, OptionsError, load_hardware, plan
from mtcore.plan.data_parallel import DpTraffic, Fsdp, exposed
from mtcore.plan.layouts import parse_layout

A100 = load_hardware("A100-80GB")
T = DpTraffic(per_step_reduce=0.0, per_microbatch_reduce=1.5, per_microbatch_gather=1.0,
              after_step_gather=0.0, last_bucket=0.1, first_unit=0.05)  # fmt: skip
FORWARD, BACKWARD, M = 0.4, 0.8, 4


def hidden(fsdp: Fsdp) -> float:
    return exposed(T, 3, "full", 1, M, FORWARD, BACKWARD, fsdp)


def test_traffic_counts_by_switch():
    """Gathers a step: 2 m resharded, m not, 1 with neither resharding nor a reduction
    before the step's end; reduce-scatters: m, or 1."""
    assert T.total(M, 3, Fsdp()) == pytest.approx(M * 1.5 + 2 * M * 1.0)
    assert T.total(M, 3, Fsdp(reshard=False)) == pytest.approx(M * 1.5 + M * 1.0)
    assert T.total(M, 3, Fsdp(reduce="step")) == pytest.approx(1.5 + 2 * M * 1.0)
    assert T.total(M, 3, Fsdp(reshard=False, reduce="step")) == pytest.approx(1.5 + 1.0)


def test_exposure_by_switch():
    # FULL_SHARD: each backward hides its gather and reduce-scatter (1.7 left), each
    # forward its gather (0.6 left)
    assert hidden(Fsdp()) == pytest.approx(M * ((1.0 + 1.5 - 0.8) + (1.0 - 0.4)))
    # no resharding: no backward gathers; each backward hides its reduce-scatter alone
    assert hidden(Fsdp(reshard=False)) == pytest.approx(M * ((1.5 - 0.8) + (1.0 - 0.4)))
    # reduced once a step: the last backward reduces, the other three hide their gathers
    assert hidden(Fsdp(reduce="step")) == pytest.approx(
        M * (1.0 - 0.4) + (1.0 + 1.5 - 0.8) + (M - 1) * (1.0 - 0.8)
    )
    # neither: one gather behind the first forward, one reduce-scatter behind the last backward
    assert hidden(Fsdp(reshard=False, reduce="step")) == pytest.approx((1.0 - 0.4) + (1.5 - 0.8))
    # no prefetch: every gather waits, the reduce-scatters still hide behind backward
    assert hidden(Fsdp(prefetch=0)) == pytest.approx(M * (1.0 + 1.0 + (1.5 - 0.8)))
    assert exposed(T, 3, "none", 1, M, FORWARD, BACKWARD, Fsdp(reduce="step")) == pytest.approx(
        1.5 + 2 * M * 1.0
    )


def test_memory_by_switch():
    """bf16 on 8 ranks: reduced once a step the fp32 gradients stay whole (4 bytes a
    parameter, not 4/8); without resharding the whole stage is gathered (2 bytes a
    parameter) where FULL_SHARD holds two gathered units and prefetch 2 three (the
    largest unit here: the embedding with its positions)."""
    params = LAYERS * BLOCK + EMBED
    base = plan(config(), 8, A100, Options(zero=3))
    step = plan(config(), 8, A100, Options(zero=3, fsdp_reduce="step"))
    assert base.ranks[0].grads == pytest.approx(4 * params / 8)
    assert step.ranks[0].grads == pytest.approx(4 * params)
    whole = plan(config(), 8, A100, Options(zero=3, fsdp_reshard=False)).ranks[0].transient
    deeper = plan(config(), 8, A100, Options(zero=3, fsdp_prefetch=2)).ranks[0].transient
    assert whole - base.ranks[0].transient == pytest.approx(2 * params - 2 * 2 * EMBED)
    assert deeper - base.ranks[0].transient == pytest.approx(2 * EMBED)
    assert step.assumed["fsdp"] == "reshard, reduce once a step, prefetch 1"
    assert "fsdp" not in base.assumed


def test_switches_need_zero_3_and_sane_values():
    with pytest.raises(OptionsError, match="the fsdp switches describe ZeRO-3"):
        plan(config(), 8, A100, Options(zero=1, fsdp_reshard=False))
    with pytest.raises(OptionsError, match="fsdp prefetch must be a whole number"):
        Options(fsdp_prefetch=-1)
    with pytest.raises(OptionsError, match="fsdp reduce must be one of microbatch, step"):
        Options(fsdp_reduce="bucket")
    _, options = parse_layout("zero=3,reshard=off,reduce=step,prefetch=2")
    assert options == {"zero": 3, "fsdp_reshard": False, "fsdp_reduce": "step", "fsdp_prefetch": 2}
