"""What a LoRA checkpoint says about its base, and finding that base again.

A LoRA run's checkpoints hold the adapters alone (and their optimizer state, the RNG
streams, the data position); the frozen weights stay in the base checkpoint the run
started from, which the manifest names under ``lora.base``:

* ``{"path": ..., "step": N, "manifest_sha256": ...}``: the base's step directory and
  the checksum of its ``manifest.json`` (which lists every file's checksum), so a base
  replaced or changed since is refused rather than silently combined with adapters
  trained on another model;
* ``{"init_seed": S}``: no checkpoint was loaded; the base is the model as the seed
  initialises it (tests, and adapters on a model trained from scratch in the same run).
"""

from __future__ import annotations

from pathlib import Path

from mtcore.training.checkpoint import manifest as mf
from mtcore.training.checkpoint.compat import check_model_matches
from mtcore.training.checkpoint.safe_reader import dcp_load, tensor_shapes


def checkpoint_reference(directory: Path) -> dict:
    """The ``lora.base`` record of the committed checkpoint ``directory``."""
    directory = Path(directory).resolve()
    step = mf.read_manifest(directory)["step"]
    return {
        "path": str(directory),
        "step": step,
        "manifest_sha256": mf.sha256_file(directory / mf.MANIFEST),
    }


def init_reference(seed: int) -> dict:
    """The ``lora.base`` record of a base that is the model's initialisation at ``seed``."""
    return {"init_seed": int(seed)}


def base_directory(reference: dict, adapters: Path) -> Path | None:
    """The base checkpoint directory ``reference`` names, checked against its recorded
    manifest checksum (None for an initialisation base); CheckpointError naming both
    checkpoints when it is gone or changed."""
    if not isinstance(reference, dict) or (
        "path" not in reference and "init_seed" not in reference
    ):
        raise mf.CheckpointError(f"{adapters}: lora.base is malformed: {reference!r}")
    if "path" not in reference:
        return None
    directory = Path(reference["path"])
    if not (directory / mf.MANIFEST).is_file():
        raise mf.CheckpointError(
            f"{adapters} holds LoRA adapters of the base checkpoint {directory}, which is "
            f"gone (no {mf.MANIFEST}); put it back or load the adapters onto a copy of it"
        )
    found = mf.sha256_file(directory / mf.MANIFEST)
    if found != reference.get("manifest_sha256"):
        raise mf.CheckpointError(
            f"{adapters} holds LoRA adapters of the base checkpoint {directory}, but that "
            f"checkpoint changed since (manifest sha256 {found[:12]}..., recorded "
            f"{str(reference.get('manifest_sha256'))[:12]}...)"
        )
    return directory


def lora_part(checkpointer, directory: Path, manifest: dict) -> str:
    """Which parameters ``directory`` holds for the ``Checkpointer``'s engine ("all"
    without LoRA, "base" for a plain checkpoint under LoRA, else "adapters"), and the
    base its saves will name; an adapter checkpoint's base is loaded here first, checked
    like any load (checksums on rank 0, the model config)."""
    saved = manifest.get("lora")
    if checkpointer.lora is None:
        if saved is not None:
            raise mf.CheckpointError(
                f"{directory} holds LoRA adapters only: load it with finetune.lora set, "
                "or merge them into the base with mtcore convert to-hf"
            )
        return "all"
    if saved is None:
        checkpointer.base = checkpoint_reference(directory)
        return "base"
    base = base_directory(saved.get("base"), directory)
    if base is None:
        if saved["base"]["init_seed"] != checkpointer.engine.seed:
            raise mf.CheckpointError(
                f"{directory} holds adapters of the model initialised at seed "
                f"{saved['base']['init_seed']}, not {checkpointer.engine.seed} (training.seed)"
            )
    else:
        checkpointer._verify_on_rank0(base)
        check_model_matches(
            mf.read_manifest(base).get("model_config"), checkpointer.engine.config, base
        )
        targets, apply = checkpointer.state.load_targets(tensor_shapes(base), False, part="base")
        dcp_load(targets, base, checkpointer.world)
        apply()
    checkpointer.base = saved["base"]
    return "adapters"
