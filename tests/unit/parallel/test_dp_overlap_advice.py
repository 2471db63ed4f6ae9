"""Whether the dp gradient buckets reduce during backward: the backend's advice
(``BackendSpec.dp_overlap``; musa's says no below arch 3.1), overridden by
``MTCORE_DP_OVERLAP``; the engine builds its DataParallel with the answer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtcore.backend import Availability, Backend, plugin_registry
from mtcore.distributed import ParallelLayout
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.data import dp_overlap
from mtcore.training.engine import Engine


def _cpu(advice=None) -> Backend:
    registry = plugin_registry()
    spec, info = registry.backends().backends["cpu"]
    return Backend(replace(spec, dp_overlap=advice), info.name, registry.kernels_for("cpu", "cpu"))


def test_the_backends_advice_decides_unless_the_user_does(monkeypatch):
    monkeypatch.delenv("MTCORE_DP_OVERLAP", raising=False)
    assert dp_overlap(_cpu()) == (True, "backend 'cpu': overlap")
    no = _cpu(lambda: Availability(False, "collectives stall compute here"))
    assert dp_overlap(no) == (False, "backend 'cpu': after backward (collectives stall compute here)")
    assert dp_overlap(_cpu(lambda: Availability(True)))[0] is True
    monkeypatch.setenv("MTCORE_DP_OVERLAP", "1")
    assert dp_overlap(no) == (True, "MTCORE_DP_OVERLAP=1")
    monkeypatch.setenv("MTCORE_DP_OVERLAP", "0")
    assert dp_overlap(_cpu()) == (False, "MTCORE_DP_OVERLAP=0")
    monkeypatch.setenv("MTCORE_DP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="MTCORE_DP_OVERLAP must be 0 or 1"):
        dp_overlap(_cpu())


def test_the_engine_builds_data_parallel_with_the_answer(monkeypatch):
    monkeypatch.delenv("MTCORE_DP_OVERLAP", raising=False)
    model = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
    for advice, overlap in ((None, True), (lambda: Availability(False, "no"), False)):
        engine = Engine(model, ParallelLayout.single(), _cpu(advice), micro_batch_size=2,
                        num_microbatches=2)  # fmt: skip
        assert engine.ddp.config.overlap_grad_reduce is overlap
