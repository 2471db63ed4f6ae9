"""PEFT's LoRA adapter format <-> mtcore's adapters of a Llama-style GPT.

A PEFT adapter directory is ``adapter_config.json`` (``peft_type: LORA``, ``r``,
``lora_alpha``, ``lora_dropout``, ``target_modules``) and ``adapter_model.safetensors``
with one ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per adapted module,
named after the transformers model (``PeftModel.save_pretrained`` drops the adapter's
own name):

=============================================  ======================================
mtcore (``GPT`` with ``add_lora``)             PEFT (``base_model.model.`` + ...)
=============================================  ======================================
``layers.i.attn.qkv.lora.q.A`` / ``.B``        ``model.layers.i.self_attn.q_proj.lora_A.weight`` / ``lora_B``
``layers.i.attn.qkv.lora.k`` / ``.v``          ``self_attn.k_proj`` / ``self_attn.v_proj``
``layers.i.attn.proj.lora.o``                  ``self_attn.o_proj``
``layers.i.mlp.fc1.lora.gate`` / ``.up``       ``mlp.gate_proj`` / ``mlp.up_proj``
``layers.i.mlp.fc2.lora.fc2``                  ``mlp.down_proj``
=============================================  ======================================

Both compute ``x W^T + (alpha / r) * x A^T B^T`` (PEFT's default, not rsLoRA or DoRA),
so the tensors map as they are. PEFT settings mtcore's adapters do not have (DoRA,
rsLoRA, trained biases, per-module ranks, ``modules_to_save``) are refused by name, as
are dense models with latent attention or MoE layers (their PEFT names are not mapped).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.common.lora import LoRAConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# mtcore's (linear, section) -> the transformers module, and the target naming it
MODULES = {
    ("attn.qkv", "q"): "self_attn.q_proj",
    ("attn.qkv", "k"): "self_attn.k_proj",
    ("attn.qkv", "v"): "self_attn.v_proj",
    ("attn.proj", "o"): "self_attn.o_proj",
    ("mlp.fc1", "gate"): "mlp.gate_proj",
    ("mlp.fc1", "up"): "mlp.up_proj",
    ("mlp.fc2", "fc2"): "mlp.down_proj",
}
TARGET_MODULES = {"q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"], "o": ["o_proj"],
                  "fc1": ["gate_proj", "up_proj"], "fc2": ["down_proj"]}  # fmt: skip
_MINE = re.compile(
    r"^layers\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.lora\.(\w+)\.([AB])$"
)
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$")


def check_peft_exportable(config) -> None:
    """HFInteropError unless ``config`` is a dense Llama-style model with standard attention."""
    if getattr(config, "mla", None) is not None or getattr(config, "experts", None) is not None:
        raise HFInteropError(
            "PEFT adapters are mapped for dense Llama-style models only (this one has "
            "latent attention or MoE layers); export the merged model instead"
        )


def to_peft_tensors(adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """PEFT's names (``base_model.model.model.layers...``) of mtcore's adapter tensors."""
    out = {}
    for name, tensor in adapters.items():
        match = _MINE.match(name)
        if match is None or (match.group(2), match.group(3)) not in MODULES:
            raise HFInteropError(f"adapter {name!r} has no PEFT name")
        layer, linear, section, which = match.groups()
        module = MODULES[(linear, section)]
        out[f"{PREFIX}model.layers.{layer}.{module}.lora_{which}.weight"] = tensor
    return out


def from_peft_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """mtcore's adapter names of a PEFT adapter's tensors (either prefix)."""
    modules = {theirs: mine for mine, theirs in MODULES.items()}
    out = {}
    for name, tensor in tensors.items():
        match = _THEIRS.match(name.removeprefix(PREFIX))
        if match is None or match.group(2) not in modules:
            raise HFInteropError(
                f"PEFT tensor {name!r} is not a Llama q/k/v/o/gate/up/down adapter"
            )
        layer, module, which = match.groups()
        linear, section = modules[module]
        out[f"layers.{layer}.{linear}.lora.{section}.{which}"] = tensor
    return out


def peft_config(lora: LoRAConfig, base_model: str | None = None) -> dict:
    """``adapter_config.json`` of ``lora`` as PEFT writes it for a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(m for t in lora.targets for m in TARGET_MODULES[t]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
    }


# PEFT settings whose value other than this would change what the adapter computes
_PLAIN = {"bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
          "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
          "layers_to_transform": None}  # fmt: skip


def lora_from_peft_config(data: dict, where: str) -> LoRAConfig:
    """The ``LoRAConfig`` of a PEFT ``adapter_config.json``; HFInteropError naming the
    setting it cannot represent."""
    if data.get("peft_type") != "LORA":
        raise HFInteropError(f"{where}: peft_type {data.get('peft_type')!r} is not LORA")
    for key, plain in _PLAIN.items():
        if data.get(key) not in (None, {}, [], False, "none"):
            raise HFInteropError(f"{where}: {key}={data[key]!r} is not supported (only {plain!r})")
    modules = data.get("target_modules") or []
    if isinstance(modules, str):
        raise HFInteropError(f"{where}: target_modules as a pattern ({modules!r}) is not supported")
    names = {m.rpartition(".")[2] for m in modules}
    targets = []
    for target, theirs in TARGET_MODULES.items():
        present = [m for m in theirs if m in names]
        if present and len(present) != len(theirs):  # mtcore adapts gate and up together
            raise HFInteropError(f"{where}: target_modules has {present} without {theirs}")
        if present:
            targets.append(target)
    unknown = sorted(names - {m for ms in TARGET_MODULES.values() for m in ms})
    if unknown:
        raise HFInteropError(f"{where}: target_modules {unknown} have no mtcore linear")
    return LoRAConfig(
        rank=data["r"], alpha=data["lora_alpha"], dropout=data.get("lora_dropout", 0.0),
        targets=targets,
    )  # fmt: skip


def export_peft(config, lora: LoRAConfig, adapters: dict[str, Tensor], out_dir: str | Path,
                dtype: torch.dtype = torch.float32, base_model: str | None = None) -> Path:  # fmt: skip
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` of the adapters of
    a ``config`` model into ``out_dir`` (the family's ``HFAdapter.export_adapter``)."""
    from safetensors.torch import save_file

    check_peft_exportable(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in to_peft_tensors(adapters).items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    text = json.dumps(peft_config(lora, base_model), indent=2, sort_keys=True)
    (out / ADAPTER_CONFIG).write_text(text + "\n")
    return out


def import_peft(adapter_dir: str | Path, config) -> tuple[LoRAConfig, dict[str, Tensor]]:
    """The ``LoRAConfig`` and fp32 adapter tensors (mtcore names) of a PEFT directory of
    a ``config`` model (the family's ``HFAdapter.import_adapter``)."""
    from safetensors.torch import load_file

    check_peft_exportable(config)
    directory = Path(adapter_dir)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a PEFT adapter directory")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise HFInteropError(f"{config_path} is not JSON: {e}") from None
    lora = lora_from_peft_config(data, str(config_path))
    tensors = {k: v.float() for k, v in load_file(str(weights_path)).items()}
    return lora, from_peft_tensors(tensors)
