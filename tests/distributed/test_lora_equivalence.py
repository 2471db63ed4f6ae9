"""LoRA fine-tuning trains the same under any layout as in one process (gloo).

Every case runs the trainer's own ``Engine`` with ``finetune.lora`` (the base frozen,
adapters on q, k, v, o, fc1 and fc2) for three steps, fp32, clipping active, and is
compared with a one-process ``Engine`` (``mtcore.testing.equivalence``): the loss and
gradient norm of every step, the evaluation loss, every final weight (base and
adapters) and, outside ZeRO, the last step's adapter gradients, relative error <= 1e-5.
Each rank also reports what its data-parallel wrapper and optimizer hold: the adapters'
elements alone, no gradient buffer for a frozen weight.

Default suite: one spawn of 8 ranks, tp2 x pp2 x dp2 with and without sequence
parallel. Extended (``make test-extended``): ZeRO-1/2/3, zero bubble, context
parallel, expert parallel (the shared expert adapted, the routed experts frozen),
latent attention, full recompute, interleaving and a tied embedding over pipeline stages.
"""

from __future__ import annotations

import pytest

from mtcore.models.common.lora import LoRAConfig, is_adapter
from mtcore.models.gpt import GPTConfig
from mtcore.testing.compare import rel_error
from mtcore.testing.equivalence import (
    Case,
    Setup,
    assert_matches,
    full_gradients,
    spawn,
    token_batches,
)
from mtcore.training.config import OptimizerConfig

STEPS, BATCH, MB = 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MOE = dict(num_experts=4, top_k=2, ffn_size=32, shared_ffn_size=16)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
LATENT = dict(SIZES, num_kv_heads=None, mla=MLA, first_dense_layers=1, ffn_hidden_size=48)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "llama_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **SIZES),
    "moe": GPTConfig(init_std=0.1, moe=MOE, **SIZES),
    "latent": GPTConfig(init_std=0.1, moe=MOE, **LATENT),
}
LORA = LoRAConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o", "fc1", "fc2"])
LATENT_LORA = LoRAConfig(rank=4, alpha=8.0, targets=["q_up", "kv_up", "o", "fc1", "fc2"])
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)


def _adapter_records(engine, record: dict) -> None:
    """The last step's adapter gradients (gathered whole on rank 0; not under ZeRO, whose
    ranks hold shards) and what DataParallel and the optimizer hold on this rank."""
    params = [(n, p) for chunk in engine.chunks for n, p in chunk.named_parameters()]
    adapters = sum(p.numel() for n, p in params if is_adapter(n))
    record["adapter_elements"] = adapters
    record["trainable"] = sorted(n for n, p in params if p.requires_grad and not is_adapter(n))
    record["frozen_with_grads"] = sorted(
        n for n, p in params if hasattr(p, "main_grad") and not p.requires_grad
    )
    record["buffer_elements"] = sum(p.numel() for b in engine.ddp.grad_buffers for p in b.params)
    record["optimizer_elements"] = sum(s.end - s.start for s in engine.optimizer.segments)
    record["sharded"] = engine.optimizer.sharded
    grads = None if engine.optimizer.sharded else full_gradients(engine)
    record["last_grads"] = (
        None if grads is None else {n: g for n, g in grads.items() if is_adapter(n)}
    )


SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False, lora={**dict.fromkeys(MODELS, LORA), "latent": LATENT_LORA},
              probe=_adapter_records)  # fmt: skip
CASES = {
    "tp2_pp2_dp2": Case(8, "llama", dict(tp=2, pp=2, dp=2)),
    "tp2_pp2_dp2_sp": Case(8, "llama", dict(tp=2, pp=2, dp=2, sequence_parallel=True)),
}
EXTENDED_CASES = {
    "tp2_sp": Case(2, "gpt2", dict(tp=2, sequence_parallel=True)),
    "pp2_tied": Case(2, "gpt2", dict(pp=2)),
    "cp2": Case(2, "llama", dict(cp=2)),
    "cp2_a2a": Case(2, "llama", dict(cp=2, cp_method="a2a")),
    "ep2_moe": Case(2, "moe", dict(ep=2)),
    "tp2_dp2_sp_zero1": Case(4, "llama", dict(tp=2, dp=2, sequence_parallel=True), zero=1),
    "tp2_dp2_zero2": Case(4, "llama", dict(tp=2, dp=2), zero=2),
    "tp2_dp2_zero3": Case(4, "llama", dict(tp=2, dp=2), zero=3),
    "tp2_pp2_zb": Case(4, "llama", dict(tp=2, pp=2), schedule="zb_h1"),
    "tp2_pp2_vpp2_sp_tied": Case(4, "gpt2", dict(tp=2, pp=2, vpp=2, sequence_parallel=True)),
    "tp2_dp2_full": Case(4, "llama_full", dict(tp=2, dp=2)),
    "cp2_tp2_sp": Case(4, "gpt2", dict(cp=2, tp=2, sequence_parallel=True)),
    "ep2_tp2_sp_moe": Case(4, "moe", dict(ep=2, tp=2, sequence_parallel=True)),
    "latent_tp2_sp_pp2": Case(4, "latent", dict(tp=2, pp=2, sequence_parallel=True)),
}


def _check(runs, setup: Setup, cases: dict, name: str) -> None:
    ranks, ref = runs[name]
    assert_matches(setup, name, cases[name], ranks, ref, eval_names={"loss", "lm"})
    for rank, got in enumerate(ranks):
        assert got["trainable"] == [] and got["frozen_with_grads"] == [], (name, rank)
        # Every trainable element is an adapter's: the buffers hold them alone (padding
        # aside), and the optimizer owns all of them, or its shard under ZeRO.
        assert got["buffer_elements"] == got["adapter_elements"], (name, rank)
        if got["sharded"]:
            assert 0 < got["optimizer_elements"] < got["adapter_elements"], (name, rank)
        else:
            assert got["optimizer_elements"] == got["adapter_elements"], (name, rank)
    if not ranks[0]["sharded"]:
        want, got = ref["last_grads"], ranks[0]["last_grads"]
        assert set(got) == set(want) and want, name
        for tensor, value in want.items():
            assert value.abs().max() > 0, (name, tensor)  # A too: B is no longer zero
            assert rel_error(got[tensor], value) <= setup.rtol, (name, tensor)
    changed = [n for n, w in ref["weights"].items() if is_adapter(n) and n.endswith(".B")]
    assert changed and all(ref["weights"][n].abs().max() > 0 for n in changed), name


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64))


@pytest.mark.parametrize("case", list(CASES))
def test_lora_layout_matches_one_process(runs, case):
    _check(runs, SETUP, CASES, case)


@pytest.fixture(scope="module")
def extended_runs():
    return spawn(SETUP, EXTENDED_CASES, token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64))


@pytest.mark.extended
@pytest.mark.parametrize("case", list(EXTENDED_CASES))
def test_lora_extended_layout_matches_one_process(extended_runs, case):
    _check(extended_runs, SETUP, EXTENDED_CASES, case)
