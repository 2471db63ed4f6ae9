"""The BERT model in one process: configuration, the chunk contract, padding, sizes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from mtcore.backend import select_backend
from mtcore.models import FamilyError, family_of, parse_model_config
from mtcore.models.bert import Bert, BertConfig, full_weight_shapes, load_full_weights
from mtcore.models.common.layers import single_context
from mtcore.parallel.layout import LayoutError, LayoutSpec

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, seq_len=16, dropout=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw) -> BertConfig:
    return BertConfig(**{**SIZES, "init_std": 0.1, **kw})


def _model(config: BertConfig, seed: int = 0) -> Bert:
    return Bert(config, single_context(config, select_backend("cpu"), seed))


def _batch(b: int = 3, s: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tokens, two segments, padding after a per-row length, ~30% of real tokens labelled."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([s, s - 5, 4][:b])
    positions = torch.arange(s)[None]
    padding_mask = positions < lengths[:, None]
    labels = torch.randint(0, 64, (b, s), generator=g)
    chosen = (torch.rand(b, s, generator=g) < 0.3) & padding_mask
    chosen[:, 1] = True  # at least one label per row
    return {
        "tokens": torch.randint(0, 64, (b, s), generator=g),
        "token_types": (positions >= lengths[:, None] // 2).long().expand(b, s).clone(),
        "padding_mask": padding_mask,
        "labels": labels.masked_fill(~chosen, -100),
        "pair_labels": torch.randint(0, 2, (b,), generator=g),
    }


def _total(terms: dict) -> torch.Tensor:
    return sum(total / count for total, count in terms.values())


def test_config_rejects_foreign_keys_bad_shapes_and_layouts():
    with pytest.raises(FamilyError, match="rope_theta"):
        parse_model_config({"family": "bert", "rope_theta": 1.0})
    assert isinstance(parse_model_config({"family": "bert", **SIZES}), BertConfig)
    with pytest.raises(ValidationError, match="not divisible by num_heads"):
        BertConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValidationError, match="pair_task"):
        BertConfig(pair_task="mlm")
    config = _config(ffn_hidden_size=42)
    config.check_layout(LayoutSpec(tp=2, pp=2, vpp=2, sequence_parallel=True))
    config.check_layout(LayoutSpec(cp=2, tp=2, sequence_parallel=True))  # context parallel
    refused = {
        "4 attention heads are not divisible by tp=8": (config, LayoutSpec(tp=8)),
        "ffn_hidden_size=42 is not divisible by tp=4": (config, LayoutSpec(tp=4)),
        "66 vocabulary entries are not divisible by tp=4": (
            _config(vocab_size=66),
            LayoutSpec(tp=4),
        ),
        "sequence length 16 is not divisible by 2\\*cp = 2\\*3 = 6": (config, LayoutSpec(cp=3)),
        "a2a splits each tp rank's 2 attention heads \\(4 / tp=2\\) over cp=4": (
            config,
            LayoutSpec(tp=2, cp=4, cp_method="a2a"),
        ),
        "ep=2": (config, LayoutSpec(ep=2)),
        "pp\\*vpp = 4\\*2": (config, LayoutSpec(pp=4, vpp=2)),
    }
    for needle, (model_config, spec) in refused.items():
        with pytest.raises(LayoutError, match=needle):
            model_config.check_layout(spec)
    structure = config.structure()
    assert structure["family"] == "bert" and structure["pair_head"] is True
    assert "dropout" in config.numerics() and "dropout" not in structure


def test_forward_backward_and_the_chunk_contract():
    config = _config()
    model, batch = _model(config), _batch()
    mlm_logits, pair_logits = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
    assert mlm_logits.shape == (3, 16, 64) and pair_logits.shape == (3, 2)
    out = model.stage({}, batch)
    torch.testing.assert_close(out["mlm_logits"], mlm_logits, rtol=0, atol=0)
    terms = model.loss(out, batch)
    counts = family_of(config).loss_counts(config, batch)
    assert set(terms) == set(counts) == {"mlm", "pair"}
    for name, (_, count) in terms.items():
        assert int(count) == int(counts[name])
    assert int(counts["mlm"]) == int((batch["labels"] != -100).sum()) and int(counts["pair"]) == 3
    # the sum is the plain token cross-entropy over the labelled positions
    want = torch.nn.functional.cross_entropy(
        mlm_logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
    )
    torch.testing.assert_close(terms["mlm"][0], want)
    _total(terms).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got no gradient"
    metrics = model.metrics(out, batch)
    valid = batch["labels"] != -100
    correct = ((mlm_logits.argmax(-1) == batch["labels"]) & valid).sum()
    assert metrics["mlm_accuracy"] == (correct, valid.sum())
    assert int(metrics["pair_accuracy"][1]) == 3
    assert set(metrics) == set(family_of(config).metric_names(config))
    assert model.tied_copies() == [] and "mlm.decoder.weight" not in model.state_dict()


def test_no_pair_task_has_no_pooler_and_no_pair_term():
    config = _config(pair_task="none")
    model, batch = _model(config), _batch()
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if n.startswith(("pooler", "pair"))], names
    out = model.stage({}, batch)
    assert set(out) == {"mlm_logits"}
    assert (
        set(model.loss(out, batch)) == {"mlm"} == set(family_of(config).loss_counts(config, batch))
    )
    assert set(model.metrics(out, batch)) == {"mlm_accuracy"}
    assert family_of(config).metric_names(config) == ("mlm_accuracy",)
    assert model(batch["tokens"])[1] is None


@pytest.mark.parametrize("pair_task", ["nsp", "none"])
def test_num_params_and_full_weight_shapes_match_the_built_model(pair_task):
    config = _config(pair_task=pair_task, ffn_hidden_size=40, type_vocab_size=3)
    model = _model(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == full_weight_shapes(config)
    assert config.flops_per_step(8) > 6 * config.num_params() * 8 * 16 * 0.5


def test_padding_changes_nothing_for_real_tokens():
    """Three real tokens alone, and with 13 padding positions of arbitrary ids behind them."""
    config = _config()
    model, batch = _model(config), _batch()
    tokens, types = batch["tokens"][:, :3], batch["token_types"][:, :3]
    alone, alone_pair = model(tokens, types, torch.ones(3, 3, dtype=torch.bool))
    mask = torch.arange(16)[None].expand(3, 16) < 3
    padded, padded_pair = model(batch["tokens"], batch["token_types"], mask)
    torch.testing.assert_close(padded[:, :3], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_pair, alone_pair, rtol=1e-5, atol=1e-5)
    unmasked, _ = model(batch["tokens"], batch["token_types"])
    assert (unmasked[:, :3] - alone).abs().max() > 1e-3  # the mask is what hides them


def test_pipeline_chunks_in_one_process_equal_the_whole_model():
    """Two chunks (embeddings | heads) chained: the same logits and loss, the decoder copy
    is a tied copy left out of the checkpoint names, and full weights load into both."""
    config = _config()
    whole, batch = _model(config, seed=5), _batch()
    c = single_context(config, select_backend("cpu"), seed=5)
    head = Bert(config, c, range(0, 2), first=True, last=False)
    tail = Bert(config, c, range(2, 4), first=False, last=True)
    torch.testing.assert_close(tail.mlm.decoder.weight, head.embed.word.weight, rtol=0, atol=0)
    assert "mlm.decoder.weight" not in tail.own_parameter_names()
    assert tail.tied_copies() == [tail.mlm.decoder.weight]
    assert head.tied_copies() == [head.embed.word.weight]
    assert set(head.own_parameter_names()) | set(tail.own_parameter_names()) == set(
        whole.state_dict()
    )
    hidden = head.stage({}, batch)
    assert set(hidden) == {"hidden"} and hidden["hidden"].shape == (3, 16, 32)
    out = tail.stage(hidden, batch)
    want = whole.stage({}, batch)
    for name in ("mlm_logits", "pair_logits"):
        torch.testing.assert_close(out[name], want[name], rtol=1e-6, atol=1e-6)
    # other weights (seed 9) loaded into both chunks give that model's logits
    other = _model(config, seed=9)
    load_full_weights([head, tail], other.state_dict())
    torch.testing.assert_close(
        tail.stage(head.stage({}, batch), batch)["mlm_logits"],
        other.stage({}, batch)["mlm_logits"],
        rtol=1e-6,
        atol=1e-6,
    )


def test_recompute_gives_the_same_gradients():
    batch, grads = _batch(), {}
    for recompute in ("none", "selective", "full"):
        model = _model(_config(recompute=recompute), seed=2)
        _total(model.loss(model.stage({}, batch), batch)).backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    for recompute in ("selective", "full"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[recompute][name], grad, rtol=1e-6, atol=1e-7)


def test_messages_are_the_hidden_states():
    from mtcore.parallel.layout import ParallelLayout

    config = _config()
    specs = family_of(config).messages(config, ParallelLayout.single(), 2, torch.bfloat16)
    assert specs(0)["hidden"].shape == (2, 16, 32) and specs(0)["hidden"].dtype == torch.bfloat16
