"""A HuggingFace Llama imported under tp=2 x pp=2 gives transformers' logits (one spawn).

The test process makes two random tiny ``LlamaForCausalLM`` (transformers), saves them
and computes their logits. Four gloo ranks each import the directory themselves
(``import_llama``: safetensors only), build their chunks with ``build_gpt``, load their
shards with ``load_full_weights`` and run the tokens through the pipeline stages
(blocking p2p, as the engine's evaluation does); the last stage gathers the
vocab-parallel logits over tp. Cases: untied at tp2 x pp2; tied with interleaved
stages and sequence parallelism at tp2 x pp2 x vpp2 (the last stage's output layer is
a copy of the embedding, loaded from ``embed.tok.weight``).
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend.collective import P2P
from mtcore.models.common.decoder.weights import load_full_weights
from mtcore.models.gpt import build_gpt
from mtcore.models.gpt.hf import import_llama
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16
CASES = {
    "untied_tp2_pp2": (False, dict(tp=2, pp=2)),
    "tied_tp2_pp2_vpp2_sp": (True, dict(tp=2, pp=2, vpp=2, sequence_parallel=True)),
}


def _hf_model(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    torch.manual_seed(int(tied))
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _forward(chunks, layout, collective, tokens):
    """Tokens through every virtual stage in order; full logits on the last stage."""
    pp_ranks, r = layout.ranks_of[Axis.PP], layout.pp_rank
    group = layout.group(Axis.PP)
    sp = chunks[0].c.sequence_parallel
    shape = (tokens.shape[0], SEQ // layout.tp if sp else SEQ, chunks[0].config.hidden_size)
    for c, chunk in enumerate(chunks):
        x = tokens
        if not (r == 0 and c == 0):
            x = torch.empty(shape)
            for h in collective.batch_send_recv(
                [P2P("recv", x, pp_ranks[(r - 1) % layout.pp], group)]
            ):
                h.wait()
        out = chunk(x)
        if chunk.last:
            return chunk.tp.all_gather(out, dim=-1)  # [b, s, vocab / tp] -> [b, s, vocab]
        send = P2P("send", out.contiguous(), pp_ranks[(r + 1) % layout.pp], group)
        for h in collective.batch_send_recv([send]):
            h.wait()
    return None


def _rank_main(ctx, directories, tokens):
    torch.set_num_threads(1)
    out = {}
    for name, (_tied, layout_kw) in CASES.items():
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        config, weights = import_llama(directories[name], seq_len=SEQ)
        chunks = build_gpt(config, layout, ctx.backend, seed=123)  # seed: not the imported numbers
        load_full_weights(chunks, weights)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out[name] = _forward(chunks, layout, ctx.backend.collective, tokens)
    return out


def test_imported_llama_gives_transformers_logits_under_tp2_pp2(tmp_path):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    directories, expected = {}, {}
    for name, (tied, _) in CASES.items():
        model = _hf_model(tied)
        directories[name] = tmp_path / name
        model.save_pretrained(directories[name])
        with torch.no_grad():
            expected[name] = model(tokens).logits
    results = run_ranks(_rank_main, 4, directories, tokens)
    for name in CASES:
        # Only the last pipeline stage (a tp pair of ranks) returns logits.
        last = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(last) == 2, name
        for logits in last:
            torch.testing.assert_close(logits, expected[name], atol=1e-5, rtol=1e-5)
