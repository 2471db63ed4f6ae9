"""What every ``mtcore convert`` direction (HF, Megatron) and ``mtcore generate`` share
about the checkpoint they read or the one they wrote: which step was read, that its
weights are finite, and the config that trains from it."""

from __future__ import annotations

from pathlib import Path


def step_to_read(command: str, path) -> tuple[Path, str]:
    """The committed step directory ``path`` names (a root: its latest), and the line that
    says which step ``command`` read, to print once it succeeded: a root that another run's
    save moved would otherwise be exported or sampled without a word of which model."""
    from mtcore.training.checkpoint import resolve_checkpoint
    from mtcore.training.checkpoint.manifest import read_manifest

    directory = resolve_checkpoint(path)
    given = Path(path).expanduser()
    via = "" if given.resolve() == directory.resolve() else f" (the latest commit under {given})"
    step = read_manifest(directory)["step"]
    return directory, f"mtcore {command}: read step {step}: {directory}{via}"


def check_finite(weights, hf_dir: str) -> None:
    """Refuse NaN or inf weights: they would train to NaN at the first step, or
    silently where the tensor is rarely used (an embedding row)."""
    import torch

    for name, tensor in weights.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(
                    f"{hf_dir}: weight {name!r} holds {bad} NaN or inf value(s) of "
                    f"{tensor.numel()}; not converted"
                )


def training_hint(config, directory, has_tokenizer: bool) -> str:
    """The config sections that train from the new checkpoint: the trainer builds the
    model its config describes, so it must be this one."""
    import yaml

    model = {"family": config.family, **config.model_dump(mode="json", exclude_defaults=True)}
    directory = directory.resolve()
    sections = {"model": model, "checkpoint": {"load": str(directory)}}
    if has_tokenizer:
        sections["data"] = {"tokenizer": str(directory / "tokenizer.json")}
    text = yaml.safe_dump(sections, sort_keys=False).rstrip()
    return f"To train from it, use these settings in the training config:\n{text}"
