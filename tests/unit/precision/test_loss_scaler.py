"""Loss scalers, the found-inf helpers and the MixedPrecision config (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from mtcore.precision import (
    DynamicLossScaler,
    LossScaler,
    MixedPrecision,
    agree_found_inf,
    found_non_finite,
)


def test_constant_scaler_scales_and_unscales_exactly():
    s = LossScaler(8.0)
    assert s.scale_loss(torch.tensor(3.0)).item() == 24.0
    g = [torch.tensor([8.0, -16.0]), torch.tensor([0.5])]
    s.unscale_(g)
    assert g[0].tolist() == [1.0, -2.0] and g[1].item() == 0.0625
    s.update(True)
    assert s.scale == 8.0
    one = torch.tensor(2.0)
    assert LossScaler().scale_loss(one) is one
    with pytest.raises(ValueError):
        LossScaler(0.0)


def test_dynamic_scaler_backs_off_and_grows():
    s = DynamicLossScaler(initial_scale=16.0, growth_interval=3, min_scale=4.0)
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    s.update(True)
    assert s.scale == 4.0  # clamped at min_scale
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0  # third clean step in a row
    s.update(False)
    s.update(True)  # an overflow resets the growth count
    s.update(False)
    s.update(False)
    assert s.scale == 4.0


def test_hysteresis_tolerates_overflows_until_growth():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=2, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0
    s.update(True)
    assert s.scale == 32.0
    s.update(True)  # tracker stays exhausted until the scale grows again
    assert s.scale == 16.0
    s.update(False)
    s.update(False)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 32.0


def test_dynamic_scaler_state_round_trip():
    s = DynamicLossScaler(initial_scale=32.0, growth_interval=5)
    s.update(False)
    s.update(True)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (
        t.state_dict()
        == s.state_dict()
        == {"scale": 16.0, "growth_tracker": 0, "hysteresis_tracker": 0}
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(growth_interval=0),
        dict(hysteresis=0),
    ],
)
def test_dynamic_scaler_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


def test_found_non_finite():
    finite = [torch.ones(3), torch.zeros(2, 2)]
    assert found_non_finite(finite).item() == 0.0
    for bad in (math.inf, -math.inf, math.nan):
        t = torch.ones(4)
        t[2] = bad
        assert found_non_finite([*finite, t]).item() == 1.0
    assert found_non_finite([]).item() == 0.0
    assert found_non_finite([torch.ones(2, dtype=torch.float16)]).dtype == torch.float32


def test_agree_found_inf_without_groups_is_local():
    assert agree_found_inf(torch.tensor(1.0), collective=None, groups=[None, None]) is True
    assert agree_found_inf(torch.tensor(0.0), collective=None, groups=[]) is False


def test_mixed_precision_config():
    assert MixedPrecision("bf16").param_dtype == torch.bfloat16
    assert MixedPrecision(torch.float16).param_dtype == torch.float16
    assert MixedPrecision("bf16").make_loss_scaler() is None
    assert MixedPrecision().make_loss_scaler() is None
    fp16 = MixedPrecision("fp16", initial_scale=128.0, growth_interval=7).make_loss_scaler()
    assert isinstance(fp16, DynamicLossScaler) and fp16.scale == 128.0 and fp16.growth_interval == 7
    const = MixedPrecision("fp16", loss_scale=4.0).make_loss_scaler()
    assert type(const) is LossScaler and const.scale == 4.0
    assert isinstance(
        MixedPrecision("bf16", loss_scale="dynamic").make_loss_scaler(), DynamicLossScaler
    )
    mp = MixedPrecision("bf16")
    assert mp.grad_dtype == mp.master_dtype == torch.float32
    module = mp.cast_module(torch.nn.Linear(2, 2))
    assert module.weight.dtype == torch.bfloat16
    for bad in (dict(param_dtype="int8"), dict(param_dtype=torch.float64), dict(loss_scale="auto")):
        with pytest.raises(ValueError):
            MixedPrecision(**bad)
