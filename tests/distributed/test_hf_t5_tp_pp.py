"""A HuggingFace T5 (v1.1) imported under tp=2 x pp=2 gives transformers' logits (one spawn).

The test process makes a random tiny ``T5ForConditionalGeneration`` (transformers,
3 encoder and 5 decoder layers, untied head), saves it (safetensors) and computes its
logits on padded encoder inputs and decoder inputs. Four gloo ranks each import the
directory through the t5 family's HF adapter, build their chunks from another seed
(the numbers must come from the import), load their shards and run the micro-batch
through the stages in order (blocking p2p of every message the family names: the two
hidden states and a stack's position bias). Cases: tp2 x pp2 (stage 0 holds the
encoder and the decoder's first layer) and tp2 x pp2 x vpp2 with sequence
parallelism (the boundary inside virtual stage 1, the messages sequence shards).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mtcore.backend.collective import P2P
from mtcore.models.t5.family import FAMILY
from mtcore.models.t5.weights import load_full_weights
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks

VOCAB, SEQ, DEC = 96, 16, 8
CASES = {
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_pp2_vpp2_sp": dict(tp=2, pp=2, vpp=2, sequence_parallel=True),
}


def _p2p(collective, kind, tensor, peer, group):
    for handle in collective.batch_send_recv([P2P(kind, tensor, peer, group)]):
        handle.wait()


def _forward(chunks, config, layout, collective, batch):
    """The batch through every virtual stage in order; full logits on the last stage."""
    pp_ranks, r, group = layout.ranks_of[Axis.PP], layout.pp_rank, layout.group(Axis.PP)
    messages = FAMILY.messages(config, layout, batch["tokens"].shape[0], torch.float32)
    for c, chunk in enumerate(chunks):
        stage = c * layout.pp + r
        inputs = {}
        if stage > 0:
            for name, spec in messages(stage - 1).items():
                inputs[name] = torch.empty(spec.shape, dtype=spec.dtype)
                _p2p(collective, "recv", inputs[name], pp_ranks[(r - 1) % layout.pp], group)
        out = chunk.stage(inputs, batch)
        if chunk.last:
            return chunk.tp.all_gather(out["logits"], dim=-1)  # [b, s, V/tp] -> [b, s, V]
        for name, spec in messages(stage).items():
            assert out[name].shape == spec.shape, (name, out[name].shape, spec.shape)
            _p2p(collective, "send", out[name].contiguous(), pp_ranks[(r + 1) % layout.pp], group)
    return None


def _rank_main(ctx, directory, batch):
    torch.set_num_threads(1)
    out = {}
    for name, layout_kw in CASES.items():
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        config, weights = FAMILY.hf.import_dir(directory, seq_len=SEQ)
        config = config.model_copy(update={"decoder_seq_len": DEC})
        chunks = FAMILY.build(config, layout, ctx.backend, seed=123).chunks
        load_full_weights(chunks, weights)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            out[name] = _forward(chunks, config, layout, ctx.backend.collective, batch)
    return out


def test_imported_t5_gives_transformers_logits_under_tp2_pp2(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=5,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=12,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration(hf_config).eval()
        model.save_pretrained(tmp_path, safe_serialization=True)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, VOCAB, (2, SEQ), generator=g)
    decoder = torch.randint(2, VOCAB, (2, DEC), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[1, 9:] = False
    with torch.no_grad():
        want = model(input_ids=tokens, attention_mask=mask.long(), decoder_input_ids=decoder).logits
    batch = {"tokens": tokens, "padding_mask": mask, "decoder_tokens": decoder}
    results = run_ranks(_rank_main, 4, tmp_path, batch)
    for name in CASES:
        last = [results[rank][name] for rank in range(4) if results[rank][name] is not None]
        assert len(last) == 2, name  # the last stage's tp pair
        for logits in last:
            err = (logits - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), (name, err, want.abs().max().item())
