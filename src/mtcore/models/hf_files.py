"""The HuggingFace model directory as files: what every family's HF adapter reads and writes.

A transformers model directory is ``config.json``, the weights in ``model.safetensors``
(or the shards ``model.safetensors.index.json`` lists) and, optionally, a
``tokenizer.json`` with its ``tokenizer_config.json``. What the config and the tensor
names mean is each family's own mapping (``gpt/hf.py``: Llama, ``bert/hf.py``: BERT);
reading and writing the files, and refusing what cannot be read, is the same for
every family, so it is here, once: a malformed file then reads the same error
whichever family imports it. transformers is not needed; only safetensors is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The dtypes an export writes, by the name config.json's ``torch_dtype`` gives them.
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFInteropError(ValueError):
    """A model, config or file that cannot map between mtcore and a HuggingFace format."""


# -- config.json -----------------------------------------------------------------------
def read_config(directory: Path) -> dict:
    """The parsed ``config.json`` of a model directory."""
    if not (directory / CONFIG).is_file():
        raise HFInteropError(f"no HuggingFace model at {directory} (expected {directory / CONFIG})")
    try:
        return json.loads((directory / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise HFInteropError(f"{directory / CONFIG} is not valid JSON: {e}") from e


def need(hf: dict, key: str):
    """``hf[key]``, which the mapping cannot do without."""
    if hf.get(key) is None:
        raise HFInteropError(f"config.json lacks {key!r}")
    return hf[key]


def check_model_type(hf: dict, model_type: str, hf_name: str, mtcore_name: str) -> None:
    """Refuse a config of another architecture (``model_type``) or a quantized one:
    the family's mapping knows the tensors of unquantized ``model_type`` models only."""
    if hf.get("model_type") != model_type:
        raise HFInteropError(
            f"model_type={hf.get('model_type')!r}: only HuggingFace {hf_name} (model_type "
            f"{model_type!r}) maps onto mtcore's {mtcore_name}"
        )
    if hf.get("quantization_config"):
        raise HFInteropError("quantized checkpoints (quantization_config) cannot be imported")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# -- safetensors -----------------------------------------------------------------------
def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index lists."""
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFInteropError(
                f"{directory / INDEX} is not a safetensors index (a 'weight_map' of tensor "
                f"name -> file): {type(e).__name__}: {e}"
            ) from e
    else:
        found = sorted(p.name for p in directory.iterdir())
        raise HFInteropError(
            f"{directory} has neither {WEIGHTS} nor {INDEX} (found: {', '.join(found)}); "
            "pickled pytorch_model.bin files are not read (convert them to safetensors)"
        )
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        except Exception as e:  # safetensors raises its own error types for bad files
            raise HFInteropError(f"cannot read {path}: {e}") from e
    return tensors


def write_weights_and_config(
    out: Path, config: dict, tensors: dict[str, Tensor], dtype: torch.dtype
) -> None:
    """``model.safetensors`` (``tensors`` in ``dtype``, on the host) and ``config.json``."""
    # clone(): safetensors refuses tensors that share storage (the split views do).
    tensors = {k: v.detach().to("cpu", dtype).clone() for k, v in tensors.items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    _readable_like_other_files(out / WEIGHTS)
    write_json(out / CONFIG, config)


def _readable_like_other_files(path: Path) -> None:
    """safetensors writes its file owner-only (0600); give it the mode ``open()`` would
    (0666 less the umask), so a shared export is readable like its config.json."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


class TensorTaker:
    """A checkpoint's tensors, taken by name (as fp32) while mapping them onto mtcore's
    names. What is never taken has no place in the model: ``refuse_untaken`` names it,
    so a checkpoint of another variant is refused, not loaded in part."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise HFInteropError(f"the safetensors files lack {name!r}")
        self.used.add(name)
        return self.tensors[name].float()

    def refuse_untaken(self, model: str, ignored_suffix: str | None = None) -> None:
        """Raise naming (the first five of) the tensors not taken, but those ending in
        ``ignored_suffix`` (buffers old checkpoints carry and mtcore recomputes)."""
        untaken = set(self.tensors) - self.used
        if ignored_suffix is not None:
            untaken = {k for k in untaken if not k.endswith(ignored_suffix)}
        extra = sorted(untaken)
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise HFInteropError(f"tensors with no place in {model}: {', '.join(extra[:5])}{more}")


@contextlib.contextmanager
def as_interop_error() -> Iterator[None]:
    """A ValueError inside (a family's full-weights check) becomes an HFInteropError,
    the one error type callers of an import catch."""
    try:
        yield
    except ValueError as e:
        raise HFInteropError(str(e)) from e


# -- tokenizer -------------------------------------------------------------------------
def read_tokenizer(path: Path) -> dict:
    """The parsed ``tokenizer.json`` at ``path``."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFInteropError(f"cannot read tokenizer {path}: {e}") from e


def added_token_ids(tokenizer: dict) -> dict[str, int]:
    """content -> id of a parsed tokenizer.json's added (special) tokens."""
    added = tokenizer.get("added_tokens") or []
    return {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}


def copy_tokenizer(
    out: Path, tokenizer_json: str | Path, model_max_length: int, **settings
) -> None:
    """``tokenizer_json`` into ``out`` with a ``tokenizer_config.json`` that loads it as a
    fast tokenizer; ``settings``: the family's entries (special tokens...), in order."""
    shutil.copyfile(tokenizer_json, out / TOKENIZER)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    tok_config["model_max_length"] = model_max_length
    write_json(out / TOKENIZER_CONFIG, {**tok_config, **settings})
