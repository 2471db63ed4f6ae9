"""The checkpoint Megatron-LM itself wrote (tests/data/megatron/llama_tp1: core_v0.16.1's
``save_checkpoint``, torch_dist, tp1), imported by ``mtcore convert from-megatron`` and
exported again by ``to-megatron`` both ways (legacy files at ``--tp 2``, and
``--format torch_dist``), loads strictly into a Megatron-Core 0.16.1 ``GPTModel`` at
tp2 (two gloo ranks, one spawn; the torch_dist one through
``dist_checkpointing.load``) and gives the logits Megatron-Core gave before the save.
The model is built from the arguments Megatron-LM saved in the checkpoint's
``common.pt`` (``--norm-epsilon 1e-6`` included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the [megatron] extra)")

from megatron_side import build, forward_logits, load_legacy, megatron_on_cpu

from mtcore.cli.main import main
from mtcore.testing.distributed import run_ranks
from mtcore.training.checkpoint.safe_pickle import torch_file

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "megatron" / "llama_tp1"
ARGUMENTS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
             "ffn_hidden_size", "normalization", "swiglu", "position_embedding_type",
             "add_bias_linear", "untie_embeddings_and_output_weights", "padded_vocab_size",
             "max_position_embeddings", "group_query_attention")  # fmt: skip


def _case() -> dict:
    saved = vars(torch_file(FIXTURE / "checkpoint" / "iter_0000003" / "common.pt")["args"])
    return {**{name: saved[name] for name in ARGUMENTS}, "norm_epsilon": saved["layernorm_epsilon"]}


def _rank_main(ctx, root: Path, case: dict, tokens: torch.Tensor):
    from megatron.core import dist_checkpointing, parallel_state

    torch.set_num_threads(1)
    megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build(case, seed=99)  # other weights than the export's, until it loads
    before = forward_logits(model, tokens)
    load_legacy(model, root / "legacy")
    from_legacy = forward_logits(model, tokens)
    model = build(case, seed=98)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     str(root / "torch_dist" / "iter_0000003"))  # fmt: skip
    model.load_state_dict(loaded["model"], strict=True)
    return before, from_legacy, forward_logits(model, tokens)


def test_megatron_lm_checkpoint_round_trips_into_megatron_core_at_tp2(tmp_path):
    assert main(["convert", "from-megatron", str(FIXTURE / "checkpoint"), str(tmp_path / "ck")]) == 0
    legacy, dist = tmp_path / "legacy", tmp_path / "torch_dist"
    assert main(["convert", "to-megatron", str(tmp_path / "ck"), str(legacy), "--tp", "2"]) == 0
    assert sorted(p.name for p in (legacy / "iter_0000003").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    assert main(["convert", "to-megatron", str(tmp_path / "ck"), str(dist),
                 "--format", "torch_dist"]) == 0  # fmt: skip
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    results = run_ranks(_rank_main, 2, tmp_path, _case(), reference["tokens"], timeout_s=300)
    for before, *loaded in results:
        assert (before - reference["logits"]).abs().max() > 1e-2  # the loads changed them
        for logits in loaded:
            torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=1e-5)
