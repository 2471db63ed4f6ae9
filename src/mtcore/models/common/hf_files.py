"""The HuggingFace model directory as files: what every family's HF adapter reads and writes.

A transformers model directory is ``config.json``, the weights in ``model.safetensors``
(or the shards ``model.safetensors.index.json`` lists) and, optionally, a
``tokenizer.json`` with its ``tokenizer_config.json``. An export larger than its
shard limit (``DEFAULT_MAX_SHARD_BYTES``, 5 GB, unless the caller gives one) is written
as shards ``model-0000i-of-0000n.safetensors`` with that index, as ``save_pretrained``
writes them.

Special tokens: mtcore's tokenizer never makes a special token out of text (a literal
``<|endoftext|>`` in a document is text; the data pipeline puts the end-of-document id
between documents itself). A family whose exported tokenizer must follow the same rule
passes ``split_special_tokens=True`` to ``copy_tokenizer`` (the GPT family does; T5
keeps transformers' rule, under which a sentinel's text is the sentinel). What the config and the tensor
names mean is each family's own mapping (``common/decoder/hf.py``: Llama, ``bert/hf.py``: BERT);
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
# The shard size the hub's Llama, Mistral and Qwen releases use.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# Tokens that end a document in common tokenizer.json files (as mtcore's data pipeline).
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Tokens that begin a sequence in common tokenizer.json files (Llama 3, Llama 2 and
# Mistral, Gemma); GPT-2's and mtcore's own BPE have none.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


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
    out: Path,
    config: dict,
    tensors: dict[str, Tensor],
    dtype: torch.dtype,
    max_bytes: int | None = None,
) -> None:
    """``tensors`` in ``dtype`` (on the host) and ``config.json``: one ``model.safetensors``,
    or, above ``max_bytes`` (None: ``DEFAULT_MAX_SHARD_BYTES``), shards of at most that
    many bytes in the order of ``tensors`` (a larger tensor gets a file of its own),
    with a ``model.safetensors.index.json``."""
    if max_bytes is not None and max_bytes < 1:
        raise HFInteropError(f"the shard size limit must be at least one byte, got {max_bytes}")
    # clone(): safetensors refuses tensors that share storage (the split views do).
    tensors = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in tensors.items()}
    shards = _shards(tensors, max_bytes or DEFAULT_MAX_SHARD_BYTES)
    if len(shards) == 1:
        names = [WEIGHTS]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        save_file({k: tensors[k] for k in shard}, str(out / name), metadata={"format": "pt"})
        _readable_like_other_files(out / name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
        write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(out / CONFIG, config)


def _shards(tensors: dict[str, Tensor], limit: int) -> list[list[str]]:
    """Consecutive groups of tensor names of at most ``limit`` bytes each."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


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

    def __init__(self, tensors: dict[str, Tensor], where: str = "the safetensors files"):
        self.tensors, self.where = tensors, where
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise HFInteropError(f"{self.where} lack {name!r}")
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


def end_of_document_token(path: Path) -> tuple[str, int] | None:
    """The end-of-document token of a tokenizer.json and its id (the first of
    ``EOD_CANDIDATES`` it has, as mtcore's data pipeline picks it), or None."""
    return _first_added(path, EOD_CANDIDATES)


def begin_of_sequence_token(path: Path) -> tuple[str, int] | None:
    """The tokenizer.json's own beginning-of-sequence token and its id (the first of
    ``BOS_CANDIDATES`` it has), or None when it has none."""
    return _first_added(path, BOS_CANDIDATES)


def _first_added(path: Path, candidates: tuple[str, ...]) -> tuple[str, int] | None:
    ids = added_token_ids(read_tokenizer(path))
    return next(((t, ids[t]) for t in candidates if ids.get(t) is not None), None)


def copy_tokenizer(
    out: Path, tokenizer_json: str | Path, model_max_length: int, **settings
) -> None:
    """``tokenizer_json`` into ``out`` with a ``tokenizer_config.json`` that loads it as a
    fast tokenizer; ``settings``: the family's entries (special tokens,
    ``split_special_tokens``...), in order.

    A chat tokenizer (a ``tokenizer_config.json`` beside ``tokenizer_json``, as a
    ``data.format: chat`` checkpoint holds: its chat template, its end-of-turn eos)
    keeps its own settings over the family's, and its special tokens written in a
    prompt stay tokens (no ``split_special_tokens``): the template renders them as text."""
    shutil.copyfile(tokenizer_json, out / TOKENIZER)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    tok_config["model_max_length"] = model_max_length
    beside = Path(tokenizer_json).parent / TOKENIZER_CONFIG
    if beside.is_file():
        chat = json.loads(beside.read_text())
        settings = {k: v for k, v in settings.items() if k != "split_special_tokens"}
        settings = {**settings, **{k: v for k, v in chat.items() if k != "model_max_length"}}
    write_json(out / TOKENIZER_CONFIG, {**tok_config, **settings})
