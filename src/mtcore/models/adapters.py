"""A family's interop with other checkpoint formats: two small abstract classes.

A family names a subclass (the class, not an instance: torchtitan's ``ModelSpec`` names
its state-dict adapter the same way) as ``ModelFamily.hf`` or ``ModelFamily.megatron``.
Each abstract method is a function of the adapter (a static method: adapters hold no
state). ``check_family``, when the registry hands the family out, refuses in one line
(``adapter_problem``) an adapter that leaves a method out or takes other arguments.

The family module must load without torch (``mtcore plan`` reads it), so a method that
needs torch is either a static method that imports inside, or ``imported_on_call(module,
name)``: the function, imported at its first call.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import Tensor


class imported_on_call:  # lower case: it stands in for a function
    """``module.name`` as a function that imports ``module`` when it is first called: a
    family names its adapters' functions without loading them, and torch, whenever the
    registry hands out the family (``mtcore plan``, a config's checks).
    ``inspect.signature`` sees the function's own signature (it imports the module)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"imported_on_call({self.module!r}, {self.name!r})"


class HFAdapter(ABC):
    """A family's HuggingFace interop (``mtcore convert to-hf`` / ``from-hf``).

    model_types: the ``model_type`` values of a transformers ``config.json`` it imports.
    tokenizer_tokens: special tokens an imported ``tokenizer.json`` must hold for the
      family's data pipeline (BERT's ``[CLS]``...).
    export_adapter, import_adapter: LoRA adapters in PEFT's format, None (the default)
      for a family that maps none.
    """

    model_types: ClassVar[tuple[str, ...]]
    tokenizer_tokens: ClassVar[tuple[str, ...]] = ()
    export_adapter: ClassVar[Callable[..., Any] | None] = None
    """``(config, lora, adapters, out_dir, dtype)``: the adapter files written into
    ``out_dir``."""
    import_adapter: ClassVar[Callable[..., tuple[Any, dict[str, Tensor]]] | None] = None
    """``(adapter_dir, config) -> (lora, adapters)``."""

    @staticmethod
    @abstractmethod
    def import_dir(path, seq_len) -> tuple[Any, dict[str, Tensor]]:
        """``(config, full weights)`` of the HF model directory ``path``; ``seq_len`` None:
        the model's own context length."""

    @staticmethod
    @abstractmethod
    def export_dir(config, weights, out_dir, dtype, tokenizer_json=None) -> Any:
        """Write ``weights`` (full weights of ``config``) as an HF model directory in
        ``dtype``, with ``tokenizer_json`` beside it; returns the directory."""


class MegatronAdapter(ABC):
    """A family's Megatron-LM / Megatron-Core interop (``mtcore convert from-megatron`` /
    ``to-megatron``).

    model_arguments: the Megatron-LM argument names ``config_from_args`` reads.
    to_dist: ``(config, weights) -> (tensors, extra_state_keys)`` of a torch_dist
      checkpoint, None (the default) for a family that exports only the legacy format.
    """

    model_arguments: ClassVar[tuple[str, ...]] = ()
    to_dist: ClassVar[Callable[..., tuple] | None] = None

    @staticmethod
    @abstractmethod
    def config_from_args(args, vocab_size) -> Any:
        """The family's config from Megatron-LM's arguments (a mapping of their names);
        ``vocab_size`` None: the arguments' padded vocabulary."""

    @staticmethod
    @abstractmethod
    def args_for(config, tp, pp) -> dict:
        """The Megatron-LM arguments that build the model an export of ``config`` loads."""

    @staticmethod
    @abstractmethod
    def from_dist(config, stacked) -> dict[str, Tensor]:
        """Full weights from a torch_dist checkpoint's tensors."""

    @staticmethod
    @abstractmethod
    def from_ranks(config, args, ranks) -> dict[str, Tensor]:
        """Full weights from legacy per-rank state dicts (``{(tp, pp, ep): [chunk state
        dicts]}``)."""

    @staticmethod
    @abstractmethod
    def to_ranks(config, weights, tp, pp, ep) -> dict:
        """The reverse of ``from_ranks``: per-rank state dicts of the full weights."""


# The arguments each method is called with: an adapter's function must accept them.
_CALLS: dict[type, dict[str, tuple[tuple, dict]]] = {
    HFAdapter: {
        "import_dir": (("path", None), {}),
        "export_dir": (("config", {}, "out", "dtype"), {"tokenizer_json": None}),
        "export_adapter": (("config", "lora", {}, "out", "dtype"), {}),
        "import_adapter": (("adapter_dir", "config"), {}),
    },
    MegatronAdapter: {
        "config_from_args": (({}, None), {}),
        "args_for": (("config", 1, 1), {}),
        "from_dist": (("config", {}), {}),
        "from_ranks": (("config", {}, {}), {}),
        "to_ranks": (("config", {}, 1, 1, 1), {}),
        "to_dist": (("config", {}), {}),
    },
}


def adapter_problem(adapter: object, kind: type) -> str | None:
    """What is wrong with ``adapter`` (None, or a complete subclass of ``kind`` whose
    functions take the arguments they are called with), in one line; None if nothing.
    A function named by ``imported_on_call`` is not imported to check it."""
    member = "hf" if kind is HFAdapter else "megatron"
    if adapter is None:
        return None
    if not (isinstance(adapter, type) and issubclass(adapter, kind)):
        return (
            f"{member} must be a subclass of mtcore.models.{kind.__name__} (the class) or "
            f"None, got {adapter!r}"
        )
    missing = sorted(getattr(adapter, "__abstractmethods__", ()))
    if missing:
        return (
            f"{member} ({adapter.__name__}) does not define {', '.join(missing)} "
            f"(mtcore.models.{kind.__name__})"
        )
    types = getattr(adapter, "model_types", ("",))
    if not types or not isinstance(types, tuple) or not all(isinstance(t, str) for t in types):
        return f"{member}.model_types must be a non-empty tuple of strings"
    for name, (args, kwargs) in _CALLS[kind].items():
        function = inspect.getattr_static(adapter, name)
        function = function.__func__ if isinstance(function, staticmethod) else function
        if function is None or isinstance(function, imported_on_call):
            continue
        try:
            inspect.signature(function).bind(*args, **kwargs)
        except TypeError as e:
            return f"{member}.{name}(...) breaks the contract: {e}"
    return None
