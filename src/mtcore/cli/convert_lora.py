"""``mtcore convert`` for LoRA checkpoints and PEFT adapters (``convert`` calls these).

mtcore convert to-hf LORA_CHECKPOINT OUT_DIR
    the merged model (base + alpha / r * B A), a plain HuggingFace directory.
mtcore convert to-hf LORA_CHECKPOINT OUT_DIR --adapter
    the adapters alone in PEFT's format (adapter_config.json, adapter_model.safetensors),
    for ``PeftModel.from_pretrained(base, OUT_DIR)`` on the exported base.
mtcore convert from-hf HF_DIR OUT_ROOT --adapter PEFT_DIR
    the base as OUT_ROOT/base (a weights-only checkpoint) and the PEFT adapter as
    OUT_ROOT/lora, a LoRA checkpoint naming that base; training with
    ``checkpoint.load: OUT_ROOT/lora`` and the printed ``finetune.lora`` continues it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def is_lora_checkpoint(path: str) -> bool:
    from mtcore.training.checkpoint.lora_weights import lora_manifest

    return lora_manifest(path)[1] is not None


def export_adapter(path: str, staging: str, dtype) -> None:
    """Write the PEFT adapter of the LoRA checkpoint ``path`` into ``staging``."""
    from mtcore.training.checkpoint.lora_weights import adapted_model, read_lora_weights

    config, lora, adapters, _ = read_lora_weights(path)
    adapted_model(config, lora, adapters)  # every adapter present, of its shape
    _peft(config, "export_adapter")(config, lora, adapters, staging, dtype)


def _peft(config, what: str):
    """The family's PEFT export or import, or a ValueError naming the family."""
    from mtcore.models import family_of

    family = family_of(config)
    found = getattr(family.hf, what, None) if family.hf is not None else None
    if found is None:
        raise ValueError(f"the {family.name} family maps no PEFT adapters")
    return found


def import_with_adapter(args, config, weights, tokenizer, adapter_dir: str) -> Path:
    """The base under OUT_ROOT/base and the PEFT adapter under OUT_ROOT/lora; the adapter
    checkpoint's directory. Checked before anything is written."""
    import yaml

    from mtcore.training.checkpoint import has_checkpoint, write_model_weights
    from mtcore.training.checkpoint.lora_base import checkpoint_reference
    from mtcore.training.checkpoint.lora_weights import adapted_model, write_lora_weights

    lora, adapters = _peft(config, "import_adapter")(adapter_dir, config)
    adapted_model(config, lora, adapters)  # the adapters fit this model
    root = Path(args.out_root)
    for sub in ("base", "lora"):
        if has_checkpoint(root / sub):
            raise ValueError(
                f"{root / sub} already holds checkpoints; convert into a new directory"
            )
    base = write_model_weights(root / "base", weights, config, step=0, tokenizer=tokenizer)
    directory = write_lora_weights(
        root / "lora", adapters, config, lora, checkpoint_reference(base)
    )
    model = {"family": config.family, **config.model_dump(mode="json", exclude_defaults=True)}
    sections = {
        "model": model,
        "checkpoint": {"load": str(directory.resolve())},
        "finetune": {"lora": lora.model_dump(mode="json")},
    }
    if tokenizer is not None:
        sections["data"] = {"tokenizer": str(base.resolve() / "tokenizer.json")}
    text = yaml.safe_dump(sections, sort_keys=False).rstrip()
    print(
        f"To train the adapter on, use these settings in the training config:\n{text}",
        file=sys.stderr,
    )
    return directory
