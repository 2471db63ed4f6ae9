"""LoRA on chat data (one process): configs/sft.yaml trains a base two steps, then LoRA
trains on it (``checkpoint.load``) three more on the packed conversations, loss on the
answers only: it starts from the base's weights, its loss falls, and its checkpoint
holds the adapters alone."""

from __future__ import annotations

import io

import pytest
from test_sft_train import sft_config

from mtcore.training.checkpoint.safe_reader import tensor_shapes
from mtcore.training.overrides import validate
from mtcore.training.trainer import train

pytest.importorskip("transformers")


def test_lora_fine_tunes_a_chat_model_from_its_base(chat_set, tmp_path):
    base = train(sft_config(chat_set, tmp_path, micro_batch_size=4, steps=2), stream=io.StringIO())
    data = sft_config(chat_set, tmp_path, micro_batch_size=4, steps=3).model_dump(mode="json")
    data["checkpoint"].update(load=str(base.checkpoint), dir=str(tmp_path / "lora"))
    data["optimizer"].update(warmup_steps=0, lr=1e-2)
    data["finetune"] = {"lora": {"rank": 4, "targets": ["q", "k", "v", "o", "fc1", "fc2"]}}
    config = validate(data)
    assert config.data.format == "chat" and config.data.packing
    log = io.StringIO()
    lora = train(config, stream=log)
    text = log.getvalue()
    assert f"model weights from {base.checkpoint}" in text and "lora: rank 4" in text, text
    assert lora.losses[-1] < lora.losses[0], lora.losses
    keys = [k for k in tensor_shapes(lora.checkpoint) if k.startswith("model.")]
    assert keys and all(".lora." in k for k in keys)
