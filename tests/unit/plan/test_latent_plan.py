"""The planner's multi-head latent attention (MLA) against a DeepSeek-style GPT built
here: its parameter counts exactly, and the activations one layer's forward saves for
backward and a cached generation's KV-cache bytes within 15% of what it plans
(docs/plan.md, "Latent attention and DeepSeek MoE")."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.common.decoder.model import Block
from mtcore.models.common.decoder.rope import gpt_rope_tables
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.parallel.layout import LayoutSpec
from mtcore.plan import load_hardware
from mtcore.plan.memory import kv_cache_bytes_per_token, layer_activation_bytes
from mtcore.plan.shapes import model_shape, stage_params
from mtcore.plan.stage import (
    Stage,
    rank_blocks,
    replicated_grad_seconds,
    score_products,
    weight_products,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SEQ, HIDDEN = 128, 128
MLA = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
MOE = dict(num_experts=8, top_k=2, ffn_size=64, shared_ffn_size=128, score="sigmoid")
PLAN_DOC = Path(__file__).resolve().parents[3] / "docs" / "plan.md"
TABLE_HEADER = (
    "| one forward, DeepSeek-style GPT | measured (KiB) | planned (KiB) | planned / measured - 1 |"
)
REPLICATED = ("attn.q_down.", "attn.q_norm.", "attn.kv_down.", "attn.kv_norm.")


def _config(**changes) -> GPTConfig:
    """configs/deepseek.yaml's shape, smaller: a dense first layer, then MoE layers
    with shared experts."""
    fields = dict(vocab_size=256, hidden_size=HIDDEN, num_layers=3, num_heads=4, seq_len=SEQ,
                  style="llama", ffn_hidden_size=384, init_std=0.05, mla=MLA, moe=MOE,
                  first_dense_layers=1)  # fmt: skip
    return GPTConfig(**(fields | changes))


def _params(module, prefix: str = "") -> int:
    return sum(p.numel() for n, p in module.named_parameters() if n.startswith(prefix))


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_shape_counts_the_models_parameters_exactly(q_lora_rank):
    config = _config(mla=MLA | {"q_lora_rank": q_lora_rank})
    model = GPT(config, single_context(config, select_backend("cpu")))
    shape = model_shape(config)
    assert shape.total_params == _params(model)
    for index, block in enumerate(shape.blocks):
        layer = model.layers[str(index)]
        assert block.attention_weights() == _params(layer, "attn.")
        routed = _params(layer, "mlp.experts.") + _params(layer, "mlp.grouped.")
        assert block.dense_mlp_weights() + block.expert_weights() == _params(layer, "mlp.")
        assert block.expert_weights() == routed or not block.experts
        replicated = sum(_params(layer, name) for name in REPLICATED)
        assert block.replicated_weights() == replicated > 0
        # on a tp=2 rank the down-projections are whole, the rest halved
        dense = _params(layer, "attn.") + _params(layer, "mlp.") - block.expert_weights()
        assert block.tp_rank_weights(2) == (dense - replicated) / 2 + replicated


def _saved_bytes(layer, x, rope) -> int:
    """Bytes of the distinct storages ``layer`` saves for backward in one forward (its
    input included, its parameters left out), as ``saved_tensors_hooks`` sees them."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rope)
    return sum(storages.values())


def _activation_rows() -> list[tuple[str, float, float]]:
    """``(what, measured, planned)`` bytes one layer saves for backward (micro-batch 2,
    fp32, tp=1, a fused attention): the dense first layer and a MoE layer, without and
    with selective recompute."""
    rows = []
    for recompute in ("none", "selective"):
        config = _config(recompute=recompute)
        context = single_context(config, select_backend("cpu"))
        shape, rope = model_shape(config), gpt_rope_tables(config)
        x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))
        for index, kind in ((0, "dense first layer"), (1, "MoE layer")):
            layer = Block(context, index)
            measured = _saved_bytes(layer, x.clone().requires_grad_(), rope)
            planned = layer_activation_bytes(
                shape.blocks[index], 2, 1, recompute=recompute, fused_attention=True, act_bytes=4
            )
            rows.append((f"{kind}, recompute {recompute}", measured, planned))
    return rows


def _cache_row() -> tuple[str, float, float]:
    """A cached greedy decode (2 sequences, 20 prompt tokens, 12 new) through
    ``GPT.cached_logits`` with one cache dict per layer, as ``GPT.generate`` runs it:
    the bytes per token and sequence the caches hold against the planner's."""
    config = _config()
    model = GPT(config, single_context(config, select_backend("cpu"))).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    caches = [{} for _ in range(config.num_layers)]
    with torch.no_grad():
        new, offset = tokens, 0
        for _ in range(12):
            logits = model.cached_logits(new, caches, offset)
            offset += new.shape[1]
            new = logits[:, -1:].argmax(-1)
    assert all(set(cache) == {"latent", "k_rope"} for cache in caches), caches[0].keys()
    assert all(cache["latent"].shape[1] == offset for cache in caches)
    measured = sum(c["latent"].nbytes + c["k_rope"].nbytes for c in caches) / (2 * offset)
    planned = kv_cache_bytes_per_token(model_shape(config).blocks, 4)
    return "KV cache per token (3 layers, bytes)", measured, planned


@cache
def _rows() -> tuple[tuple[str, float, float], ...]:
    return (*_activation_rows(), _cache_row())


def test_saved_activations_and_kv_cache_agree_with_the_plan():
    for what, measured, planned in _rows():
        assert abs(planned / measured - 1) < 0.15, (what, measured, planned)


def test_latent_cache_is_smaller_than_every_heads_keys_and_values():
    config = _config()
    latent = kv_cache_bytes_per_token(model_shape(config).blocks, 4)
    no_mla = config.model_copy(update={"mla": None})
    heads = kv_cache_bytes_per_token(model_shape(no_mla).blocks, 4)
    assert latent == 4 * 3 * (32 + 16) and heads == 4 * 3 * 2 * HIDDEN


def _cell(what: str, nbytes: float) -> str:
    return f"{nbytes:.0f}" if "bytes" in what else f"{nbytes / 1024:.1f}"


def test_docs_table_matches_the_measurement():
    """docs/plan.md's measured-vs-planned table is this file's numbers."""
    lines = PLAN_DOC.read_text().splitlines()
    start = lines.index(TABLE_HEADER)
    table = lines[start + 2 : start + 2 + len(_rows())]
    expected = [
        f"| {what} | {_cell(what, measured)} | {_cell(what, planned)} "
        f"| {100 * (planned / measured - 1):+.1f}% |"
        for what, measured, planned in _rows()
    ]
    assert table == expected, "\n".join(expected)


def test_prediction_modules_are_on_the_last_stage():
    """DeepSeek's MTP modules: their blocks, projections and norms on the last stage
    (the plan holds every parameter the model has but the layers' norms, which it
    leaves out of every block), their heads' passes in its time."""
    config = _config(mtp=dict(depth=2, loss_weight=0.3))
    model = GPT(config, single_context(config, select_backend("cpu")))
    shape = model_shape(config)
    assert len(shape.last_blocks) == 2 and shape.head_passes == 3
    layer_norms = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("attn_norm.weight", "mlp_norm.weight"))
    )  # fmt: skip
    blocks = [(b, 1) for b in shape.blocks + shape.last_blocks]
    whole = stage_params(shape, blocks, tp=1, ep=1, pp=1, first=True, last=True)
    assert whole.trained + whole.experts + _params(model, "norm.") + layer_norms == _params(model)
    # the last of two pipeline stages: the modules, the head and a copy of the embedding
    last = rank_blocks(shape, [3, 0], 2, 1, 1)
    assert sum(n for _, n in last) == 2
    held = stage_params(shape, last, tp=1, ep=1, pp=2, first=False, last=True)
    mtp_norms = sum(
        _params(model, f"mtp.{k}.block.{n}") for k in (0, 1) for n in ("attn_norm", "mlp_norm")
    )
    expected = (
        _params(model, "mtp.") - mtp_norms + _params(model, "embed.") + _params(model, "output.")
    )
    assert held.trained + held.experts == expected


def test_sequence_parallel_sums_the_replicated_weights_gradients_over_tp():
    """Under sequence parallel the down-projections' gradients are partial per tp rank:
    one all-reduce a step of their fp32 gradients, none without it."""
    hardware = load_hardware("H100-SXM")
    seconds = {}
    for q_lora_rank in (64, None):
        shape = model_shape(_config(mla=MLA | {"q_lora_rank": q_lora_rank}))
        stage = Stage(rank_blocks(shape, [3], 1, 1, 0), True, True)
        for tp, sp in ((2, True), (2, False), (1, False)):
            spec = LayoutSpec(tp=tp, sequence_parallel=sp)
            seconds[q_lora_rank, tp, sp] = replicated_grad_seconds(shape, stage, spec, hardware, 4)
    assert seconds[64, 2, False] == seconds[64, 1, False] == 0.0
    # no query down-projection: fewer replicated weights, a smaller all-reduce
    assert seconds[64, 2, True] > seconds[None, 2, True] > 0.0


def test_products_split_the_up_projections_and_keep_the_down_projections_whole():
    """A latent block's weight products: ``2 tokens`` FLOPs per weight the token goes
    through (norms aside), the down-projections whole on each tp rank; its score
    products at the kernel's padded head size ``max(32 + 16, 32)``."""
    block = model_shape(_config()).blocks[1]
    lat = block.latent
    down = HIDDEN * (lat.q_rank + lat.kv_rank + lat.rope)
    routed = block.top_k * 3 * HIDDEN * block.expert_ffn
    for tp in (1, 2):
        flops = sum(
            2 * m * k * n * calls for (m, k, n), calls in weight_products(block, SEQ, tp, 1)
        )
        split = block.active_weights() - lat.norm_weights() - down - routed
        assert flops == pytest.approx(2 * SEQ * ((split + routed) / tp + down))
    scores = sum(2 * m * k * n * calls for (m, k, n), calls in score_products(block, 1, 1, 1))
    assert (
        block.head_dim == 48 and scores == block.attention_product_flops() == 4 * SEQ * SEQ * 4 * 48
    )
