"""BERT under tp=2, with and without sequence parallelism, equals one process (one spawn).

Two gloo ranks build their chunk with the family's ``build`` and run one micro-batch
with padding, two segments and masked-LM labels through ``stage``, ``loss`` and
``metrics``, then backward of the loss (sum over terms of sum / count). The test
process does the same with the one-process model of the same seed. Compared, fp32,
relative error <= 1e-5: the loss terms, the MLM logits (vocab shards gathered), the
pair logits, the metrics and every parameter's gradient (shards gathered; under
sequence parallelism after the tp all-reduce of the partial LayerNorm/bias grads).
The sp case also recomputes every block (``recompute: full``).
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models import get_family
from mtcore.models.bert import Bert, BertConfig
from mtcore.models.common.layers import single_context
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.tensor import (
    allreduce_sequence_parallel_grads,
    full_tensors,
    gather_from_tp,
)
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

RTOL = 1e-5
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
CASES = {
    "tp2": (dict(tp=2), dict()),
    "tp2_sp_full": (dict(tp=2, sequence_parallel=True), dict(recompute="full")),
}


def _config(**kw) -> BertConfig:
    return BertConfig(**SIZES, dropout=0.0, init_std=0.1, **kw)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    b, s = 4, SIZES["seq_len"]
    lengths = torch.tensor([[s], [12], [7], [3]])
    padding_mask = torch.arange(s)[None] < lengths
    chosen = (torch.rand(b, s, generator=g) < 0.4) & padding_mask
    chosen[:, 1] = True
    return {
        "tokens": torch.randint(0, 64, (b, s), generator=g),
        "token_types": (torch.arange(s)[None] >= lengths // 2).long().expand(b, s).clone(),
        "padding_mask": padding_mask,
        "labels": torch.randint(0, 64, (b, s), generator=g).masked_fill(~chosen, -100),
        "pair_labels": torch.randint(0, 2, (b,), generator=g),
    }


def _step(chunk, batch) -> dict:
    """One forward and backward; every number compared, full (unsharded)."""
    out = chunk.stage({}, batch)
    terms = chunk.loss(out, batch)
    sum(total / count for total, count in terms.values()).backward()
    terms = {name: (total.detach(), count) for name, (total, count) in terms.items()}
    allreduce_sequence_parallel_grads(chunk, chunk.tp)
    return {
        "terms": {name: (total.item(), int(count)) for name, (total, count) in terms.items()},
        "metrics": {
            name: (int(correct), int(count))
            for name, (correct, count) in chunk.metrics(out, batch).items()
        },
        "mlm_logits": gather_from_tp(out["mlm_logits"].detach(), chunk.tp),
        "pair_logits": out["pair_logits"].detach(),
        "grads": full_tensors(chunk, chunk.tp, grads=True),
    }


def _rank_main(ctx, batch):
    torch.set_num_threads(1)
    family, results = get_family("bert"), {}
    for name, (layout_kw, model_kw) in CASES.items():
        spec = LayoutSpec(**layout_kw)
        layout = ParallelLayout.build(spec, ctx.backend.collective, ctx.rank, ctx.world_size)
        built = family.build(_config(**model_kw), layout, ctx.backend, seed=3)
        assert len(built.chunks) == 1
        chunk = built.chunks[0]
        if spec.sequence_parallel:  # the messages are sequence shards
            hidden = chunk.embed(batch["tokens"], batch["token_types"])
            want = family.messages(chunk.config, layout, 4, torch.float32)(0)["hidden"].shape
            assert tuple(hidden.shape) == want == (4, 8, 32), hidden.shape
        results[name] = _step(chunk, batch)
    return results


def _reference(batch, model_kw) -> dict:
    """The one-process model of the ranks' seed."""
    config = _config(**model_kw)
    return _step(Bert(config, single_context(config, select_backend("cpu"), seed=3)), batch)


@pytest.fixture(scope="module")
def runs():
    batch = _batch()
    ranks = run_ranks(_rank_main, 2, batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: (ranks, _reference(batch, CASES[name][1])) for name in CASES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_bert_matches_one_process(runs, case):
    ranks, ref = runs[case]
    assert set(ref["terms"]) == {"mlm", "pair"}
    for rank, result in enumerate(ranks):
        got = result[case]
        for term, (total, count) in ref["terms"].items():
            assert got["terms"][term][1] == count, (case, rank, term)
            err = abs(got["terms"][term][0] - total) / abs(total)
            assert err <= RTOL, f"{case} rank {rank} {term}: {got['terms'][term]} vs {total}"
        assert got["metrics"] == ref["metrics"], (case, rank)
        for name in ("mlm_logits", "pair_logits"):
            err = rel_error(got[name], ref[name])
            assert err <= RTOL, f"{case} rank {rank} {name}: rel err {err:.2e}"
        assert set(got["grads"]) == set(ref["grads"]), (case, rank)
        for name, want in ref["grads"].items():
            assert want is not None and want.abs().sum() > 0, name
            err = rel_error(got["grads"][name], want)
            assert err <= RTOL, f"{case} rank {rank} grad {name}: rel err {err:.2e}"
