"""Megatron-Core's own GPT checkpoints into mtcore and back, logits for logits (one spawn).

Four gloo ranks build a tiny Megatron-Core 0.16.1 ``GPTModel`` at tp2 x pp2 per case
and compute its logits, then save it as Megatron-LM does: torch_dist
(``dist_checkpointing.save`` of its sharded state dict) and legacy per-rank
``model_optim_rng.pt`` files. Rank 0 imports both (``read_megatron``, as ``mtcore
convert from-megatron`` does) and writes an mtcore checkpoint; every rank loads that
checkpoint into mtcore's GPT at tp2 x pp2 (another split of the same weights) and runs
the tokens; rank 0 exports it again (``write_megatron_legacy`` at tp2 x pp2, as
``to-megatron`` does, and ``write_megatron_torch_dist``, as ``to-megatron --format
torch_dist`` does) and a freshly built Megatron-Core model loads each export strictly
(the torch_dist one through ``dist_checkpointing.load`` at the case's layout: tp2 x pp2,
or tp2 x ep2) and runs the tokens once more. Cases: GPT-2 style (LayerNorm, erf GeLU, learned
positions, tied, biases), Llama style (RMSNorm, SwiGLU, RoPE, GQA, untied) and
Mixtral style (Llama with 4 experts, top-2, SequentialMLP), the last once more at
tp2 x ep2 (two experts per rank).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the [megatron] extra)")

from hf_pipeline import forward_logits as mtcore_logits
from megatron_side import build, forward_logits, load_legacy, megatron_on_cpu, save_both

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.gpt import build_gpt, load_full_weights
from mtcore.testing.distributed import run_ranks

VOCAB, SEQ = 256, 16
_COMMON = dict(num_layers=4, hidden_size=64, num_attention_heads=4, padded_vocab_size=VOCAB,
               max_position_embeddings=SEQ, seq_length=SEQ)  # fmt: skip
CASES = {
    "gpt2": dict(_COMMON, ffn_hidden_size=128, normalization="LayerNorm", swiglu=False,
                 position_embedding_type="learned_absolute", add_bias_linear=True,
                 untie_embeddings_and_output_weights=False),
    "llama_gqa": dict(_COMMON, ffn_hidden_size=96, normalization="RMSNorm", swiglu=True,
                      position_embedding_type="rope", add_bias_linear=False,
                      group_query_attention=True, num_query_groups=2,
                      untie_embeddings_and_output_weights=True),
    "mixtral": dict(_COMMON, ffn_hidden_size=96, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", add_bias_linear=False,
                    group_query_attention=True, num_query_groups=2, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=48,
                    untie_embeddings_and_output_weights=True),
}  # fmt: skip
CASES["mixtral_ep2"] = CASES["mixtral"]
# Megatron-Core's (tp, pp, ep) per case; (2, 2, 1) if not named. At ep 2 the legacy
# files are mp_rank_TT_EEE (no pipeline: the second number is the expert rank).
MEGATRON_LAYOUTS = {"mixtral_ep2": (2, 1, 2)}
TOLERANCE = 1e-4


def _rank_main(ctx, root, tokens):
    from megatron.core import dist_checkpointing, parallel_state

    from mtcore.training.checkpoint import read_model_weights, write_model_weights
    from mtcore.training.checkpoint.megatron import (
        read_megatron,
        write_megatron_legacy,
        write_megatron_torch_dist,
    )

    torch.set_num_threads(1)
    megatron_on_cpu()
    layout = ParallelLayout.build(LayoutSpec(tp=2, pp=2), ctx.backend.collective, ctx.rank, 4)
    out = {}
    for index, (name, case) in enumerate(CASES.items()):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        tp, pp, ep = MEGATRON_LAYOUTS.get(name, (2, 2, 1))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )  # fmt: skip
        saved = root / name
        model = build(case, seed=10 * index)
        out[(name, "megatron")] = forward_logits(model, tokens)
        save_both(model, case, saved, iteration=7)
        if ctx.rank == 0:
            for kind in ("torch_dist", "legacy"):
                config, weights, iteration = read_megatron(saved / kind)
                write_model_weights(saved / f"mtcore_{kind}", weights, config, step=iteration)
        torch.distributed.barrier()
        for kind in ("torch_dist", "legacy"):
            config, weights, _ = read_model_weights(saved / f"mtcore_{kind}")
            chunks = build_gpt(config, layout, ctx.backend, seed=1)
            load_full_weights(chunks, weights)
            with torch.no_grad():
                out[(name, f"mtcore_from_{kind}")] = mtcore_logits(
                    [c.eval() for c in chunks], layout, ctx.backend.collective, tokens
                )
        if ctx.rank == 0:
            config, weights, step = read_model_weights(saved / "mtcore_torch_dist")
            write_megatron_legacy(config, weights, saved / "export", tp, pp, step, ep)
            # torch_dist export: whole tensors, read at this layout
            write_megatron_torch_dist(config, weights, saved / "export_dist", step)
        torch.distributed.barrier()
        fresh = build(case, seed=10 * index + 5)
        load_legacy(fresh, saved / "export")
        out[(name, "megatron_from_export")] = forward_logits(fresh, tokens)
        fresh = build(case, seed=10 * index + 6)
        loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()},
                                         str(saved / "export_dist" / "iter_0000007"))  # fmt: skip
        fresh.load_state_dict(loaded["model"], strict=True)
        out[(name, "megatron_from_dist_export")] = forward_logits(fresh, tokens)
    return out


@pytest.mark.extended
def test_megatron_core_checkpoints_import_and_export_with_the_same_logits(tmp_path):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    results = run_ranks(_rank_main, 4, tmp_path, tokens, timeout_s=600)
    for name in CASES:
        last_stage = 4 // MEGATRON_LAYOUTS.get(name, (2, 2, 1))[1]  # ranks with logits
        megatron = [r[(name, "megatron")] for r in results if r[(name, "megatron")] is not None]
        assert len(megatron) == last_stage, name
        reference = megatron[0]
        assert reference.shape == (2, SEQ, VOCAB)
        kinds = ["mtcore_from_torch_dist", "mtcore_from_legacy", "megatron_from_export",
                 "megatron_from_dist_export"]  # fmt: skip
        for kind in kinds:
            got = [r[(name, kind)] for r in results if r[(name, kind)] is not None]
            assert len(got) == (2 if kind.startswith("mtcore") else last_stage), (name, kind)
            for logits in got:
                difference = (logits - reference).abs().max().item()
                print(f"{name} {kind}: max |dlogit| {difference:.2e}")
                assert difference < TOLERANCE, (name, kind, difference)
