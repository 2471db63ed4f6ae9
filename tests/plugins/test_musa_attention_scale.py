"""The musa backend's SDPA-scale probe (mtcore_musa.attention_scale) against stand-ins of
torch_musa's three behaviours (csrc/aten/ops/attention/mudnn/SDP.cpp, v2.7.1): a build
with MUSA >= 4.2 honours ``scale``, an older one raises on a non-default scale, one
without a MUSA version ignores it. Only the first runs a non-default scale (multi-head
latent attention's mscale, T5's 1.0) on the device; the probe runs once, and only when
a non-default scale is first asked for."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("mtcore_musa")

from mtcore_musa.attention_scale import attention_ok, flash_head_dims_ok, sdpa_honours_scale


class _HostDevice:
    """The stand-in device: its tensors are the host's."""

    def torch_device(self):
        return torch.device("cpu")


def _ignores_scale(q, k, v, scale=None, **kwargs):  # a build without a MUSA version
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _refuses_scale(q, k, v, scale=None, **kwargs):  # MUSA < 4.2
    if scale is not None and not math.isclose(scale, 1 / math.sqrt(q.shape[-1])):
        raise RuntimeError("Not support explicit `scale` parameter")
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "sdpa,honours",
    [(F.scaled_dot_product_attention, True), (_ignores_scale, False), (_refuses_scale, False)],
    ids=["musa_4_2", "no_version", "before_4_2"],
)
def test_the_probe_tells_the_three_builds_apart(sdpa, honours):
    assert sdpa_honours_scale(_HostDevice(), sdpa) is honours


def test_the_predicate_probes_once_and_only_for_a_non_default_scale():
    calls = []

    def probe():
        calls.append(1)
        return False

    ok = attention_ok(probe, flash_head_dims_ok)
    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    assert ok(q, q, q, True, None, None) and ok(q, q, q, True, None, 0.125)
    assert calls == []  # the default scale needs no probe
    assert not ok(q, q, q, True, None, 1.0) and not ok(q, q, q, True, None, 0.3)
    assert calls == [1]
    honoured = attention_ok(lambda: True, flash_head_dims_ok)
    assert honoured(q, q, q, True, None, 1.0)
    assert not honoured(q, q, q, True, None, 1.0, dropout_p=0.1)  # dropout: the reference
    wide = torch.randn(1, 2, 4, 256, dtype=torch.bfloat16)
    assert not honoured(wide, wide, wide, True, None, None)  # muDNN's head dims
