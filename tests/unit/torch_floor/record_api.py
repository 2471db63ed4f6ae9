"""Record the torch API surface mtcore's source uses, as the running torch has it.

Run in an environment with the oldest torch mtcore supports (``make torch-floor-record``
builds one and runs this); it rewrites ``torch_api_floor.json`` beside it:

* ``torch``: the version recorded;
* ``modules``: ``dir()`` of every module or class on the path of a used name, so a
  name the source starts to use later can be checked without recording again;
* ``signatures``: the parameter names of every Python-level callable in those modules
  and classes (``null`` where it takes ``**kwargs``); builtins have none to record.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scan import all_uses

OUT = Path(__file__).with_name("torch_api_floor.json")


def resolve(name: str):
    """The object a dotted torch name stands for, importing submodules as needed."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def params(obj) -> list[str] | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return None
    return [p.name for p in signature.parameters.values()]


def main() -> None:
    modules: dict[str, list[str]] = {}
    signatures: dict[str, list[str]] = {}
    uses = all_uses()
    for use in uses:  # import every submodule used first: dir() lists only imported ones
        with contextlib.suppress(ImportError, AttributeError):
            resolve(use.name)
    for use in uses:
        parts = use.name.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix in modules:
                continue
            try:
                obj = resolve(prefix)
            except (ImportError, AttributeError):
                break
            if not (inspect.ismodule(obj) or inspect.isclass(obj)):
                break
            if inspect.isclass(obj) and not obj.__module__.startswith("torch"):
                break  # a builtin type (str, int): not torch's surface
            names = set(dir(obj))
            if inspect.isclass(obj):  # attributes its metaclass provides (group.WORLD)
                names.update(n for n in dir(type(obj)) if not n.startswith("__"))
            else:  # a module's own dunders only (torch.__version__)
                names = {n for n in names if not n.startswith("__") or n in vars(obj)}
            names = sorted(names)
            if prefix == "torch.ops.aten":  # ops load lazily: list them all
                names = sorted(
                    {
                        op.split("::")[1].split(".")[0]
                        for op in torch._C._dispatch_get_all_op_names()
                        if op.startswith("aten::")
                    }
                )
            modules[prefix] = names
            for member in names:
                try:
                    target = getattr(obj, member)
                except Exception:
                    continue
                if callable(target) and (found := params(target)) is not None:
                    signatures[f"{prefix}.{member}"] = found
    record = {
        "torch": torch.__version__,
        "modules": dict(sorted(modules.items())),
        "signatures": dict(sorted(signatures.items())),
    }
    OUT.write_text(json.dumps(record, indent=0, sort_keys=False) + "\n")
    print(
        f"{OUT}: torch {torch.__version__}, {len(modules)} modules/classes, "
        f"{len(signatures)} signatures"
    )


if __name__ == "__main__":
    main()
