"""``to-megatron --format torch_dist`` with experts: Megatron-Core 0.16.1's own
``dist_checkpointing.load`` reads mtcore's export into a fresh Mixtral-style
``GPTModel`` (SequentialMLP, 4 experts, top-2) with every tensor equal to the one
Megatron saved, and the same logits, at ep 1 and at ep 2 (two experts per rank), on
two gloo ranks in one spawn. The export is whole tensors, so one file set serves both.

Round trip: Megatron-Core saves its model (torch_dist), ``read_megatron`` imports it
as ``mtcore convert from-megatron`` does, ``write_megatron_torch_dist`` exports it as
``to-megatron --format torch_dist`` does, and a fresh model loads that strictly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the [megatron] extra)")

from megatron_side import build, forward_logits, megatron_on_cpu, save_both

from mtcore.testing.distributed import run_ranks

VOCAB, SEQ = 128, 16
CASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB,
            max_position_embeddings=SEQ, seq_length=SEQ, ffn_hidden_size=64,
            normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
            add_bias_linear=False, group_query_attention=True, num_query_groups=2,
            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
            untie_embeddings_and_output_weights=True)  # fmt: skip


def _rank_main(ctx, root, tokens):
    from megatron.core import dist_checkpointing, parallel_state

    from mtcore.training.checkpoint.megatron import read_megatron, write_megatron_torch_dist

    torch.set_num_threads(1)
    megatron_on_cpu()
    out = {}
    for ep in (1, 2):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        saved = root / f"ep{ep}"
        model = build(CASE, seed=3 + ep)
        first = parallel_state.get_expert_model_parallel_rank() * (4 // ep)
        with torch.no_grad():  # every global expert apart (ep ranks draw the same values)
            for name, param in model.named_parameters():
                if ".local_experts." in name:
                    local = int(name.split(".local_experts.")[1].split(".")[0])
                    g = torch.Generator().manual_seed(1000 * (first + local) + len(name))
                    param.add_(0.3 * torch.randn(param.shape, generator=g))
        out[(ep, "megatron")] = forward_logits(model, tokens)
        save_both(model, CASE, saved, iteration=5)
        if ctx.rank == 0:
            config, weights, step = read_megatron(saved / "torch_dist")
            write_megatron_torch_dist(config, weights, saved / "export_dist", step)
        torch.distributed.barrier()
        fresh = build(CASE, seed=40 + ep)
        state = {"model": fresh.sharded_state_dict()}
        loaded = dist_checkpointing.load(state, str(saved / "export_dist" / "iter_0000005"))
        fresh.load_state_dict(loaded["model"], strict=True)
        mine, theirs = model.state_dict(), fresh.state_dict()
        tensors = [k for k, v in mine.items() if isinstance(v, torch.Tensor)]
        out[(ep, "names")] = sorted(tensors)
        out[(ep, "unequal")] = [k for k in tensors if not torch.equal(mine[k], theirs[k])]
        out[(ep, "expert0")] = theirs["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
        out[(ep, "from_export")] = forward_logits(fresh, tokens)
    return out


def test_megatron_core_loads_the_moe_torch_dist_export_at_ep1_and_ep2(tmp_path):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    results = run_ranks(_rank_main, 2, tmp_path, tokens, timeout_s=300)
    for ep in (1, 2):
        for rank, result in enumerate(results):
            names = result[(ep, "names")]
            local = 4 // ep  # experts held by this rank
            assert sum(".mlp.experts.local_experts." in n for n in names) == 2 * 2 * local, names
            assert result[(ep, "unequal")] == [], (ep, rank)
            difference = (result[(ep, "from_export")] - result[(ep, "megatron")]).abs().max()
            assert difference == 0, (ep, rank, difference.item())
    # ep 2: each rank loaded its own experts (rank 1's local expert 0 is global expert 2)
    assert not torch.equal(results[0][(2, "expert0")], results[1][(2, "expert0")])
