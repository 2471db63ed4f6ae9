"""A HuggingFace LLaVA imported under tp2 x pp2 gives transformers' logits (one spawn).

The test process makes a random tiny ``LlavaForConditionalGeneration`` (CLIP tower,
Llama language model), saves it and computes its logits for two samples, one with an
image and one with two. Four gloo ranks each import the directory (``import_llava``:
safetensors only), build their chunks (the tower on stage 0), load their shards and
run the batch through the stages (blocking p2p, as the engine's evaluation does); the
last stage gathers the vocab-parallel logits over tp. Cases: tp2 x pp2, and tp2 x pp2
with sequence parallelism (the language model's hidden states are sequence shards; the
tower's 5 tokens, class token included, are not divisible by tp and stay whole).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mtcore.backend.collective import P2P
from mtcore.models.vlm import build
from mtcore.models.vlm.hf import import_llava
from mtcore.models.vlm.weights import load_full_weights
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

# The tiny LLaVA of the unit tests (tests/unit/models/tiny_llava.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))
from tiny_llava import SEQ, hf_llava, inputs

pytest.importorskip("transformers")
CASES = {"tp2_pp2": dict(tp=2, pp=2), "tp2_pp2_sp": dict(tp=2, pp=2, sequence_parallel=True)}


def _forward(chunks, layout, collective, batch):
    pp_ranks, r, group = layout.ranks_of[Axis.PP], layout.pp_rank, layout.group(Axis.PP)
    sp = chunks[0].c.sequence_parallel
    shape = (
        batch["tokens"].shape[0],
        SEQ // layout.tp if sp else SEQ,
        chunks[0].config.hidden_size,
    )
    for chunk in chunks:
        inputs = {}
        if not chunk.first:
            inputs["hidden"] = torch.empty(shape)
            recv = P2P("recv", inputs["hidden"], pp_ranks[(r - 1) % layout.pp], group)
            for h in collective.batch_send_recv([recv]):
                h.wait()
        out = chunk.stage(inputs, batch)
        if chunk.last:
            return chunk.tp.all_gather(out["logits"], dim=-1)
        send = P2P("send", out["hidden"].contiguous(), pp_ranks[(r + 1) % layout.pp], group)
        for h in collective.batch_send_recv([send]):
            h.wait()
    return None


def _rank_main(ctx, directory, batch):
    torch.set_num_threads(1)
    out = {}
    for name, layout_kw in CASES.items():
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        config, weights = import_llava(directory)
        chunks = build(
            config, layout, ctx.backend, seed=123
        ).chunks  # seed: not the imported numbers
        load_full_weights(chunks, weights)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out[name] = _forward(chunks, layout, ctx.backend.collective, batch)
    return out


def test_imported_llava_gives_transformers_logits_under_tp2_pp2(tmp_path):
    model = hf_llava()
    model.save_pretrained(tmp_path)
    batch, ids, pixels = inputs()
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels).logits
    results = run_ranks(_rank_main, 4, tmp_path, batch)
    for name in CASES:
        last = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(last) == 2, name
        for logits in last:
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
