"""``mtcore plan`` under ``finetune.lora``: the base held as weights only, the adapters
with gradients, master weights and AdamW state; numbers computed by hand."""

from __future__ import annotations

import pytest

from mtcore.plan import Options, load_hardware, plan
from mtcore.training.overrides import load_config

MODEL = ["--model.hidden_size", "64", "--model.num_layers", "2", "--model.num_heads", "4",
         "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--model.seq_len", "32",
         "--model.vocab_size", "256", "--parallel.tp", "2", "--precision.dtype", "bf16",
         "--training.global_batch_size", "4", "--training.micro_batch_size", "2"]  # fmt: skip
LORA = ["--finetune.lora.rank", "8", "--finetune.lora.targets", "[q, k, v, o, fc1, fc2]"]


def _rank(overrides):
    result = plan(load_config(None, MODEL + overrides), 2, load_hardware("H100-SXM"), Options())
    return result.ranks[0], result.notes


def test_lora_trains_the_adapters_alone_and_holds_the_base_as_weights():
    full, _ = _rank([])
    lora, notes = _rank(LORA)
    # One block on one of 2 tp ranks, r = 8, h = 64, q = 64, kv = 32, ffn = 128:
    # q 8*64 + 8*64/2 = 768, k and v 8*64 + 8*32/2 = 640 each, o 8*64/2 + 8*64 = 768,
    # gate and up 8*64 + 8*128/2 = 1024 each, down 8*128/2 + 8*64 = 1024: 5888; 2 blocks.
    adapters = 2 * (768 + 640 + 640 + 768 + 1024 + 1024 + 1024)
    assert lora.params == adapters == 11776
    assert lora.grads == 4 * adapters and lora.master == 4 * adapters
    assert lora.optimizer == 8 * adapters
    assert lora.weights == pytest.approx(full.weights + 2 * adapters)  # bf16: base + adapters
    assert full.grads == 4 * full.params and full.optimizer == 8 * full.params
    saved = (full.grads + full.master + full.optimizer) - (
        lora.grads + lora.master + lora.optimizer
    )
    assert saved == pytest.approx(16 * (full.params - adapters))
    assert any("lora: rank 8 on q, k, v, o, fc1, fc2" in note for note in notes)
