"""Allow-listed unpickling: the one policy for every pickle mtcore reads.

DCP's ``.metadata`` (``safe_reader``) and the ``torch.save`` files other trainers
write (Megatron-LM's ``model_optim_rng.pt`` and ``common.pt``: ``torch_file``) go
through ``allowed_global``: torch's tensor rebuilders, sizes, dtypes and devices,
``OrderedDict``, ``argparse.Namespace`` (Megatron's saved arguments), paths and sets.
Anything else is refused in one line naming it, before it is imported or called.

A torch file may also hold, beside the weights, objects mtcore never uses: Megatron's
own enums and classes inside its arguments (``AttnBackend.auto``) and numpy's RNG
state arrays. In torch files a global from ``megatron`` or one of numpy's array
rebuilders becomes an ``InertObject``: it records its name and arguments, imports
nothing and runs nothing.

Standard-library enums in saved arguments (Megatron-LM 0.16's ``exit_signal =
signal.SIGTERM``, in every checkpoint it writes) are admitted one class at a time
(``_ENUMS``). A pickle names such a member as the class called with its value; the
unpickler gets not the class but a look-up that takes exactly one plain value (an int
or a str) and returns the existing member: the class's other calls (Enum's functional
API builds new classes) and its attributes stay out of reach.
"""

from __future__ import annotations

import argparse
import io
import pickle
import types
from pathlib import Path

import torch

from mtcore.training.checkpoint.manifest import CheckpointError

_ALLOWED = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a look-up of torch.strided and friends by name
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("_codecs", "encode"),  # bytes pickled as text (numpy arrays, protocol 2): str -> bytes
}
_ENUMS = {("signal", "Signals")}  # IntEnums of the standard library, no custom look-up
_TORCH_NAMES = ("layout", "memory_format", "strided", "contiguous_format")
_INERT_NUMPY = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class InertObject:
    """What an unneeded foreign global unpickles as: its name and arguments, as data."""

    def __init__(self, name: str, args: tuple = ()):
        self.name, self.args, self.state = name, args, None

    def __call__(self, *args):
        return InertObject(self.name, args)

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{self.name}{self.args!r}" if self.args else self.name


def _member_lookup(module: str, name: str):
    """``enum_class(value)`` for one int or str ``value``, and nothing else."""
    enum_class = getattr(__import__(module, fromlist=[name]), name)

    def member(*args):
        if len(args) != 1 or type(args[0]) not in (int, str):
            raise CheckpointError(f"refusing to call {module}.{name} with {args!r:.80}")
        try:
            return enum_class(args[0])
        except ValueError:
            raise CheckpointError(f"{module}.{name} has no member {args[0]!r:.40}") from None

    return member


def allowed_global(module: str, name: str):
    """The object ``module.name`` when the allow-list admits it, else None."""
    if (module, name) in _ENUMS:
        return _member_lookup(module, name)
    if (module, name) in _ALLOWED:
        return getattr(__import__(module, fromlist=[name]), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == "torch" and name in _TORCH_NAMES:
        return getattr(torch, name)
    if (module, name) == ("argparse", "Namespace"):
        return argparse.Namespace
    return None


class _TorchFileUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = allowed_global(module, name)
        if found is not None:
            return found
        if module == "megatron" or module.startswith("megatron.") or (module, name) in _INERT_NUMPY:
            return InertObject(f"{module}.{name}")
        raise CheckpointError(f"refusing to unpickle {module}.{name}")


_PICKLE_MODULE = types.SimpleNamespace(
    __name__="mtcore_allow_listed_pickle", Unpickler=_TorchFileUnpickler, load=None
)


def torch_file(path: Path) -> object:
    """``torch.load`` of a ``torch.save`` file through the allow-list, onto the CPU; a
    refused global or an unreadable file is a ``CheckpointError`` naming the file."""
    try:
        data = path.read_bytes()
        return torch.load(
            io.BytesIO(data), map_location="cpu", pickle_module=_PICKLE_MODULE, weights_only=False
        )
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # truncated, not a torch file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} is unreadable: {type(e).__name__}: {first}") from None
