"""Named pipeline messages: several tensors per boundary, changing shape from one
boundary to the next, side inputs read from the batch on every stage, an integer
message without gradient (gloo, one 2-rank spawn).

A model of four stages, each a small module, whose boundaries carry:

    stage 0 -> 1   hidden [b, 4, H], memory [b, 2, H]
    stage 1 -> 2   hidden [b, 6, H] (longer: memory appended), memory, count [b] int64
    stage 2 -> 3   hidden [b, 6, H]

runs under pp=2 with interleaving (four virtual stages: every boundary crosses
ranks) and under pp=2 with 1F1B and GPipe (two chunks of two stages: only the
middle boundary crosses), and must give the loss and every gradient of one
process, relative 1e-6.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import Tensor, nn

from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.pipeline import PipelineGroups, PipelineRunner, TensorSpec, build_schedule
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

H, MB, M, TOL = 8, 2, 4, 1e-6
SPECS = [  # what leaves stage k (k = 0, 1, 2)
    {"hidden": TensorSpec((MB, 4, H), torch.float32), "memory": TensorSpec((MB, 2, H), torch.float32)},
    {
        "hidden": TensorSpec((MB, 6, H), torch.float32),
        "memory": TensorSpec((MB, 2, H), torch.float32),
        "count": TensorSpec((MB,), torch.int64),
    },
    {"hidden": TensorSpec((MB, 6, H), torch.float32)},
]
CASES = {"interleaved": (2, "interleaved_1f1b"), "1f1b": (1, "1f1b"), "gpipe": (1, "gpipe")}


class Stage(nn.Module):
    """Stage ``k`` of the four; each reads the batch's ``mask`` (a side input)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        torch.manual_seed(100 + k)
        self.lin = nn.Linear(H, H)
        self.mem = nn.Linear(H, H)

    def forward(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        mask = batch["mask"][..., None].float()
        if self.k == 0:
            x = batch["x"]
            return {"hidden": torch.tanh(self.lin(x)) * mask, "memory": self.mem(x[:, :2])}
        if self.k == 1:
            hidden = torch.tanh(self.lin(inputs["hidden"])) * mask
            memory = torch.tanh(self.mem(inputs["memory"]))
            count = batch["mask"].sum(1)  # an integer message: no gradient travels back
            return {"hidden": torch.cat([hidden, memory], 1), "memory": memory, "count": count}
        if self.k == 2:
            scale = inputs["count"].float()[:, None, None]
            mixed = inputs["hidden"] + self.mem(inputs["memory"]).mean(1, keepdim=True)
            return {"hidden": torch.tanh(self.lin(mixed)) / scale}
        return {"out": self.mem(torch.tanh(self.lin(inputs["hidden"]))).sum(1)}


class Chunk(nn.Module):
    """Consecutive stages on one pipeline rank (the family chunk contract: ``stage``)."""

    def __init__(self, stages: list[int]):
        super().__init__()
        self.parts = nn.ModuleList(Stage(k) for k in stages)

    def stage(self, inputs, batch):
        for part in self.parts:
            inputs = part(inputs, batch)
        return inputs


def _batches() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(M):
        mask = torch.ones(MB, 4, dtype=torch.bool)
        mask[0, 3:] = False
        out.append({"x": torch.randn(MB, 4, H, generator=g), "mask": mask, "y": torch.randn(MB, H, generator=g)})
    return out


def _loss(outputs, batch) -> Tensor:
    return ((outputs["out"] - batch["y"]) ** 2).sum() / M


def _rank_main(ctx, batches):
    results = {}
    for name, (vpp, schedule_name) in CASES.items():
        layout = ParallelLayout.build(LayoutSpec(pp=2, vpp=vpp), ctx.backend.collective, ctx.rank, 2)
        stages_per_chunk = 4 // (2 * vpp)
        chunks = []
        for c in range(vpp):
            first = (c * 2 + layout.pp_rank) * stages_per_chunk
            chunks.append(Chunk(list(range(first, first + stages_per_chunk))))

        def messages(boundary: int, per=stages_per_chunk) -> dict[str, TensorSpec]:
            return SPECS[(boundary + 1) * per - 1]

        runner = PipelineRunner(
            chunks,
            build_schedule(schedule_name, 2, M, vpp),
            PipelineGroups.build(layout, ctx.backend.collective),
            ctx.backend,
            messages,
            loss_fn=_loss,
            timing=False,
        )
        stats = runner.step(batches)
        grads = {
            f"stage{part.k}.{n}": p.grad.clone()
            for chunk in chunks
            for part in chunk.parts
            for n, p in part.named_parameters()
        }
        results[name] = (stats.loss, grads)
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs():
    batches = _batches()
    ranks = [torch.load(io.BytesIO(r), weights_only=False) for r in run_ranks(_rank_main, 2, batches)]
    model = Chunk([0, 1, 2, 3])
    loss = sum(_loss(model.stage({}, b), b) for b in batches)
    loss.backward()
    ref_grads = {f"stage{p.k}.{n}": t.grad for p in model.parts for n, t in p.named_parameters()}
    return ranks, loss.item(), ref_grads


@pytest.mark.parametrize("case", list(CASES))
def test_named_messages_match_one_process(runs, case):
    ranks, ref_loss, ref_grads = runs
    losses = [r[case][0] for r in ranks]
    last = [x for x in losses if x is not None]
    assert len(last) == 1 and abs(last[0] - ref_loss) <= TOL * abs(ref_loss), (case, losses, ref_loss)
    grads = {**ranks[0][case][1], **ranks[1][case][1]}
    assert set(grads) == set(ref_grads), case
    for name, want in ref_grads.items():
        assert want.abs().sum() > 0, name  # every stage's parameters got a gradient
        assert rel_error(grads[name], want) <= TOL, (case, name)
