"""A HuggingFace BERT imported under tp=2 x pp=2 gives transformers' logits (one spawn).

The test process makes a random tiny ``BertForPreTraining`` (transformers), saves it
(safetensors) and computes its MLM and next-sentence logits on padded sentence pairs
with token types. Four gloo ranks each import the directory themselves (the bert
family's HF adapter), build their chunks with ``FAMILY.build`` (from another seed: the
numbers must come from the import), load their shards with ``load_full_weights`` and
run the micro-batch through the pipeline stages (``chunk.stage``, blocking p2p of the
hidden message; the padding mask and token types are side inputs every stage reads);
the last stage gathers the vocab-parallel MLM logits over tp. Cases: tp2 x pp2, and
tp2 x pp2 x vpp2 with sequence parallelism (the hidden message is a sequence shard, the
last stage's decoder is a copy of the embedding loaded from ``embed.word.weight``).
"""

from __future__ import annotations

import torch

from mtcore.backend.collective import P2P
from mtcore.models.bert.family import FAMILY
from mtcore.models.bert.weights import load_full_weights
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

VOCAB, SEQ, LAYERS = 96, 16, 4
CASES = {
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_pp2_vpp2_sp": dict(tp=2, pp=2, vpp=2, sequence_parallel=True),
}


def _forward(chunks, layout, collective, batch):
    """The batch through every virtual stage in order; full logits on the last stage."""
    pp_ranks, r = layout.ranks_of[Axis.PP], layout.pp_rank
    group = layout.group(Axis.PP)
    sp = chunks[0].c.sequence_parallel
    b = batch["tokens"].shape[0]
    shape = (b, SEQ // layout.tp if sp else SEQ, chunks[0].config.hidden_size)
    for c, chunk in enumerate(chunks):
        inputs = {}
        if not (r == 0 and c == 0):
            inputs["hidden"] = torch.empty(shape)
            recv = P2P("recv", inputs["hidden"], pp_ranks[(r - 1) % layout.pp], group)
            for h in collective.batch_send_recv([recv]):
                h.wait()
        out = chunk.stage(inputs, batch)
        if chunk.last:
            mlm = chunk.tp.all_gather(out["mlm_logits"], dim=-1)  # [b, s, V/tp] -> [b, s, V]
            return mlm, out["pair_logits"]
        assert set(out) == {"hidden"} and out["hidden"].shape == shape
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
        config, weights = FAMILY.hf.import_dir(directory, seq_len=None)
        chunks = FAMILY.build(config, layout, ctx.backend, seed=123).chunks
        assert len(chunks) == layout.spec.vpp
        load_full_weights(chunks, weights)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out[name] = _forward(chunks, layout, ctx.backend.collective, batch)
    return out


def test_imported_bert_gives_transformers_mlm_and_pair_logits_under_tp2_pp2(tmp_path, tiny_bert):
    model = tiny_bert.model(vocab_size=VOCAB, max_position_embeddings=SEQ, num_hidden_layers=LAYERS)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokens, token_types, padding_mask = tiny_bert.inputs(VOCAB, SEQ)
    assert not padding_mask.all() and token_types.any()
    want_mlm, want_pair = tiny_bert.logits(model, tokens, token_types, padding_mask)
    batch = {"tokens": tokens, "token_types": token_types, "padding_mask": padding_mask}
    results = run_ranks(_rank_main, 4, tmp_path, batch)
    for name in CASES:
        # Only the last pipeline stage (a tp pair of ranks) returns logits.
        last = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(last) == 2, name
        for mlm, pair in last:
            torch.testing.assert_close(mlm, want_mlm, atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(pair, want_pair, atol=1e-5, rtol=1e-5, msg=name)
