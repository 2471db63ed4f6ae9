"""The runner on one process: no pipelining (gradient accumulation) equals the full batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtcore.backend import select_backend
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.pipeline import (
    PipelineGroups,
    PipelineRunner,
    ScheduleError,
    build_schedule,
    one_f_one_b,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("name", ["no_pipelining", "gpipe", "1f1b"])
def test_single_stage_matches_full_batch(name):
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)
    ref = _model()
    _loss(ref(tokens), targets).backward()

    model = _model()
    groups = PipelineGroups.build(ParallelLayout.single(), None)
    runner = PipelineRunner([model], build_schedule(name, 1, 4), groups, select_backend("cpu"), (2, 5, 8), _loss, trace=True)
    stats = runner.step(tokens.split(2), targets.split(2))
    assert abs(stats.loss - _loss(ref(tokens), targets).item()) < 1e-6
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert stats.busy_s <= stats.total_s and stats.wait_s == 0.0
    assert len(stats.trace) == 8 and stats.peak_in_flight == (4 if name == "gpipe" else 1)


def test_runner_rejects_mismatches():
    groups = PipelineGroups.build(ParallelLayout.single(), None)
    backend = select_backend("cpu")
    with pytest.raises(ScheduleError, match="pp=2"):
        PipelineRunner([nn.Identity()], one_f_one_b(2, 2), groups, backend, (1,), _loss)
    with pytest.raises(ValueError, match="loss_fn"):
        PipelineRunner([nn.Identity()], one_f_one_b(1, 2), groups, backend, (1,))
    runner = PipelineRunner([nn.Identity()], one_f_one_b(1, 2), groups, backend, (1,), _loss)
    with pytest.raises(ValueError, match="needs 2 micro-batch inputs, got 1"):
        runner.step([torch.zeros(1)], [torch.zeros(1)] * 2)
