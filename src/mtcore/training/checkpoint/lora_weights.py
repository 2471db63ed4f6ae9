"""A LoRA checkpoint's weights outside training: read them, merge them, write them.

``read_lora_weights`` gives a LoRA checkpoint's model config, its ``LoRAConfig``, the
full adapters (named as the one-process model's, ``layers.0.attn.qkv.lora.q.A``) and
the full base weights (from the base checkpoint its manifest names, checked against
the recorded checksum, or the model as the recorded seed initialises it).
``merge_lora`` folds the adapters into the base (``W + alpha / r * B A``, section by
section), which is what ``mtcore convert to-hf`` writes by default;
``write_lora_weights`` commits adapters imported from PEFT as a weights-only LoRA
checkpoint that names its base.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mtcore.models import FamilyConfig, LoRAConfig, add_lora, family_of, is_adapter
from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.compat import saved_model_config
from mtcore.training.checkpoint.lora_base import base_directory
from mtcore.training.checkpoint.safe_reader import dcp_load, tensor_shapes
from mtcore.training.checkpoint.weights import commit_weights, read_model_weights


def lora_manifest(path: str | Path) -> tuple[Path, dict | None]:
    """The step directory of ``path`` and its manifest's ``lora`` record (None: a plain
    checkpoint)."""
    directory = mf.resolve_checkpoint(path)
    return directory, mf.read_manifest(directory).get("lora")


def read_lora_weights(
    path: str | Path,
) -> tuple[FamilyConfig, LoRAConfig, dict[str, Tensor], dict[str, Tensor]]:
    """``(model config, lora config, adapters, base weights)`` of a LoRA checkpoint, all
    full fp32 tensors; CheckpointError when ``path`` is not one or its base is gone."""
    directory, record = lora_manifest(path)
    if record is None:
        raise mf.CheckpointError(f"{directory} is not a LoRA checkpoint (no lora in its manifest)")
    manifest = mf.read_manifest(directory)
    mf.verify_files(directory, manifest)
    config = saved_model_config(manifest.get("model_config"), directory)
    lora = LoRAConfig.model_validate(record["config"])
    shapes = tensor_shapes(directory)
    keys = [k for k in shapes if k.startswith("model.") and is_adapter(k.removeprefix("model."))]
    targets = {k: torch.empty(shapes[k][0], dtype=torch.float32) for k in keys}
    dcp_load(targets, directory, world=1)
    adapters = {k.removeprefix("model."): v for k, v in targets.items()}
    base = base_directory(record.get("base"), directory)
    if base is None:
        weights = initial_weights(config, record["base"]["init_seed"])
    else:
        base_config, weights, _ = read_model_weights(base)
        # The architecture must be the base's; numerics (init_std, dropout, eps...) are the
        # LoRA run's own, as training read the base under them (compat.check_model_matches).
        if base_config.structure() != config.structure():
            raise mf.CheckpointError(f"{directory}: its base {base} is of another model config")
    return config, lora, adapters, weights


def initial_weights(config: FamilyConfig, seed: int) -> dict[str, Tensor]:
    """The one-process model's weights as ``training.seed`` initialises them."""
    from mtcore.backend import select_backend
    from mtcore.parallel.layout import ParallelLayout

    host = torch.get_rng_state()
    try:
        built = family_of(config).build(
            config, ParallelLayout.single(), select_backend("cpu"), seed
        )
    finally:
        torch.set_rng_state(host)
    chunk = built.chunks[0]
    own = set(chunk.own_parameter_names())
    return {k: v.float().clone() for k, v in chunk.state_dict().items() if k in own}


def adapted_model(config: FamilyConfig, lora: LoRAConfig, adapters: dict[str, Tensor]):
    """The one-process model with ``lora``'s adapters (it knows each linear's sections),
    after checking that ``adapters`` are exactly its adapters, of their shapes."""
    from mtcore.backend import select_backend

    host = torch.get_rng_state()  # building a model seeds the generators: leave them as found
    try:
        model = family_of(config).one_process(config, select_backend("cpu"))
        add_lora([model], lora)
    finally:
        torch.set_rng_state(host)
    wanted = {n: p.shape for n, p in model.named_parameters() if is_adapter(n)}
    for problem, names in (
        ("lack", sorted(set(wanted) - set(adapters))),
        ("have unexpected", sorted(set(adapters) - set(wanted))),
        ("have misshapen", sorted(n for n in set(wanted) & set(adapters)
                                  if adapters[n].shape != wanted[n])),
    ):  # fmt: skip
        if names:
            raise mf.CheckpointError(
                f"the adapters {problem} tensors for rank {lora.rank} on "
                f"{', '.join(lora.targets)} of this model: {', '.join(names[:3])}"
            )
    return model


@torch.no_grad()
def merge_lora(
    config: FamilyConfig, lora: LoRAConfig, adapters: dict[str, Tensor], weights: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The base ``weights`` with every adapted linear's ``alpha / r * B A`` added (a new
    dict; the adapters' names are not in it)."""
    model = adapted_model(config, lora, adapters)
    model.load_state_dict({**weights, **adapters}, strict=False)
    merged = dict(weights)
    for name, module in model.named_modules():
        if getattr(module, "lora", None) is not None:
            key = f"{name}.weight"
            merged[key] = weights[key] + module.lora.merged_delta().to(weights[key].dtype)
    return merged


def write_lora_weights(
    root: str | Path,
    adapters: dict[str, Tensor],
    model_config: FamilyConfig,
    lora: LoRAConfig,
    base: dict,
    *,
    step: int = 0,
) -> Path:
    """Commit ``<root>/step_<step>/`` holding only ``adapters`` (full tensors), a
    weights-only LoRA checkpoint whose base is ``base`` (``lora_base``'s record)."""
    record = {"config": lora.model_dump(mode="json"), "base": base}
    return commit_weights(root, adapters, model_config, step=step, lora=record)
