"""One-process access to any checkpoint: the full model weights in, the full weights out.

``read_model_weights`` reads a checkpoint whatever layout saved it (no process
group): DCP assembles each logical tensor from the ranks' pieces, and fused
parameters are joined from their sections. ``write_model_weights`` writes a
committed *weights-only* checkpoint (no optimizer or trainer state), which the
trainer starts from under any layout with a fresh optimizer at step 0
(Megatron's ``--finetune``); ``mtcore convert`` uses both.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from mtcore.models import FamilyConfig, family_of
from mtcore.parallel.tensor import named_tp_parameters
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.compat import saved_model_config
from mtcore.training.checkpoint.logical import join_full, section_entry, split_full
from mtcore.training.checkpoint.safe_reader import dcp_load, dcp_save, tensor_shapes


def read_model_weights(path: str | Path) -> tuple[FamilyConfig, dict[str, Tensor], int]:
    """``(model config, full fp32 weights named as the family's one-process model, step)``.

    Checksums are verified first (a CheckpointError names a bad file). Low-precision
    training checkpoints give their fp32 master weights; a LoRA checkpoint its base's
    weights with the adapters merged in (``lora_weights``). The result is complete: every
    weight of the recorded model config, of its shape, or a CheckpointError.
    """
    config, weights, step, _ = _read(path)
    return config, weights, step


def _read(path) -> tuple[FamilyConfig, dict[str, Tensor], int, Path]:
    directory = mf.resolve_checkpoint(path)
    manifest = mf.read_manifest(directory)
    if manifest.get("lora") is not None:  # adapters alone: merged into their base
        from mtcore.training.checkpoint.lora_weights import merge_lora, read_lora_weights

        config, lora, adapters, base = read_lora_weights(directory)
        return config, merge_lora(config, lora, adapters, base), int(manifest["step"]), directory
    mf.verify_files(directory, manifest)
    config = saved_model_config(manifest.get("model_config"), directory)
    shapes = tensor_shapes(directory)
    model_keys = [k for k in shapes if k.startswith("model.")]
    targets = {k: torch.empty(shapes[k][0], dtype=torch.float32) for k in model_keys}
    masters = {
        k: "optim.master." + k.removeprefix("model.")
        for k in model_keys
        if "optim.master." + k.removeprefix("model.") in shapes
    }
    targets.update({m: torch.empty(shapes[m][0], dtype=torch.float32) for m in masters.values()})
    dcp_load(targets, directory, world=1)
    flat = {k.removeprefix("model."): targets[masters.get(k, k)] for k in model_keys}
    try:
        weights = join_full(flat, manifest.get("sections") or {})
    except (RuntimeError, IndexError) as e:
        raise mf.CheckpointError(
            f"{directory / mf.MANIFEST}: its sections do not fit: {e}"
        ) from None
    # Buffers the one-process model lacks are an FP8 run's training state (amax history,
    # scale), which the one-process model (and HuggingFace export) has no place for.
    return config, _model_entries(config, weights, directory), int(manifest["step"]), directory


def _model_entries(config: FamilyConfig, weights: dict[str, Tensor], directory: Path):
    """The one-process model's entries of ``weights``: every one, of its shape, or a
    CheckpointError (a checkpoint whose tensors are not those of its model config)."""
    model = _template(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = {k: v for k, v in shapes.items() if not k.startswith("layers.")}
    for index in range(config.num_layers):
        stem = f"layers.{config.template_layer(index)}."
        for key, shape in shapes.items():
            if key.startswith(stem):
                expected[f"layers.{index}." + key.removeprefix(stem)] = shape
    out = {k: v for k, v in weights.items() if _template_key(config, k) in shapes}
    missing = sorted(set(expected) - set(out))
    extra = sorted(set(out) - set(expected))
    wrong = sorted(k for k in set(out) & set(expected) if out[k].shape != expected[k])
    for problem, names in (("lacks", missing), ("has unexpected", extra), ("has misshapen", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise mf.CheckpointError(
                f"checkpoint {directory} {problem} weights for the model its {mf.MANIFEST} "
                f"records: {', '.join(names[:3])}{more}"
            )
    return out


def _template_key(config: FamilyConfig, name: str) -> str:
    """``name`` in the template model: layer i's entries are its template layer's."""
    match = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if match is None:
        return name
    return f"layers.{config.template_layer(int(match.group(1)))}.{match.group(2)}"


def _past_the_stack(config: FamilyConfig, name: str) -> bool:
    match = re.match(r"^layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= config.num_layers


def _template(config: FamilyConfig):
    """The family's one-process model of the first ``config.template_layers`` layers,
    which stand for every layer (``config.template_layer``)."""
    from mtcore.backend import select_backend

    layers = min(config.num_layers, config.template_layers)
    template = config.model_copy(update={"num_layers": layers})
    host = torch.get_rng_state()  # building a model seeds the generators: leave them as found
    try:
        return family_of(config).one_process(template, select_backend("cpu"))
    finally:
        torch.set_rng_state(host)


def write_model_weights(
    root: str | Path,
    weights: dict[str, Tensor],
    model_config: FamilyConfig,
    *,
    step: int = 0,
    tokenizer=None,
) -> Path:
    """Commit ``<root>/step_<step>/`` holding only ``weights`` (full tensors named as in
    the family's one-process model); returns the directory. ``tokenizer``: an mtcore
    tokenizer (written as ``tokenizer.json``) or None."""
    sections = model_sections(model_config, weights)
    return commit_weights(
        root, split_full(weights, sections), model_config, step=step, tokenizer=tokenizer,
        sections=sections,
    )  # fmt: skip


def commit_weights(
    root: str | Path, tensors: dict[str, Tensor], model_config: FamilyConfig, *, step: int,
    tokenizer=None, sections: dict | None = None, **header,
) -> Path:  # fmt: skip
    """Commit ``<root>/step_<step>/``: a weights-only checkpoint of ``tensors`` (float32,
    whole; named as the model's), ``header`` added to its manifest (a LoRA
    checkpoint's ``lora`` record)."""
    saved = {f"model.{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    staging = mf.begin(Path(root).expanduser(), step)
    if tokenizer is not None:
        (staging / "tokenizer.json").write_text(tokenizer.hf.to_str())
    dcp_save(saved, staging, world=1)
    manifest = {
        "step": step,
        "kind": "weights",
        "layout": None,
        "model_config": model_config.model_dump(mode="json"),
        "sections": sections or {},
        **header,
    }
    return mf.commit(staging, manifest)


def model_sections(config: FamilyConfig, names) -> dict[str, dict]:
    """The multi-section (fused) parameters among ``names``, from a small template model
    whose first layers stand for every layer (``config.template_layer``)."""
    model = _template(config)
    known = {name: section_entry(part) for name, _, part, _ in named_tp_parameters(model)}
    known.update({name: None for name, _ in model.named_buffers()})
    out = {}
    for name in names:
        key = _template_key(config, name)
        if _past_the_stack(config, name) or (
            key not in known and not _owned_by_a_module(model, key)
        ):
            raise mf.CheckpointError(
                f"weight {name!r} is not a parameter of this {config.family} model"
            )
        if key not in known:  # a buffer the template lacks (FP8 amax history): replicated
            continue
        if known[key] is not None:
            out[name] = known[key]
    return out


def _owned_by_a_module(model, name: str) -> bool:
    prefix = name.rpartition(".")[0]
    try:
        model.get_submodule(prefix)
    except AttributeError:
        return False
    return bool(prefix)


def load_model(path: str | Path, backend=None):
    """The one-process model of a checkpoint (eval mode), its step and its directory."""
    config, weights, step, directory = _read(path)
    model = family_of(config).one_process(config, backend)
    model.load_state_dict(weights, strict=True)
    model.train(False)
    return model, step, directory
