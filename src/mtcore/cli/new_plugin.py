"""Write the skeleton of a plugin that adds an accelerator to mtcore.

  mtcore new-plugin NAME [--device-type TYPE] [--c10d BACKEND] [--dest DIR] [--force]

writes the directory mtcore-NAME (or DIR): a pyproject.toml with the entry point
(group mtcore.plugins), the package mtcore_NAME (plugin.py: the backend NAME on
mtcore's generic device TorchModuleDevice, a Collective over the c10d backend, FP8;
kernels.py: a kernel pack with swiglu), a README that says what to fill in, and
tests/test_conformance.py, which runs mtcore's conformance kit against NAME.

With --device-type cpu --c10d gloo the skeleton runs on the host as generated and
passes the kit: pip install it, then pytest tests/. An existing directory is left
alone unless --force. docs/plugin-author-guide.md explains each piece.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HELP = "write the skeleton of a plugin for a new accelerator (backend NAME)"

# Backends mtcore itself provides: a plugin claiming one of these names would put
# the name in conflict, and it would then serve nobody.
BUILT_IN_BACKENDS = ("cpu",)
_IDENT = r"[a-z][a-z0-9_]*"
NAME = re.compile(_IDENT)
# A c10d backend string: "name", or a device map as init_process_group takes it
# ("cpu:gloo,dev:name").
C10D = re.compile(rf"{_IDENT}|{_IDENT}:{_IDENT}(,{_IDENT}:{_IDENT})*")


class SkeletonError(ValueError):
    """Bad input for new-plugin; nothing was written."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        metavar="NAME",
        help="the backend's name, what users select (MTCORE_BACKEND=NAME): lowercase "
        "letters, digits and _, starting with a letter; the package is mtcore_NAME",
    )
    parser.add_argument(
        "--device-type",
        metavar="TYPE",
        default=None,
        help="the accelerator's torch device type, as in torch.device('TYPE:0'). Default: "
        "NAME, the usual choice for an out-of-tree device (a PrivateUse1 backend renamed "
        "with torch.utils.rename_privateuse1_backend). 'cpu' makes a skeleton that runs "
        "on the host and passes the conformance kit as generated",
    )
    parser.add_argument(
        "--c10d",
        metavar="BACKEND",
        default="gloo",
        help="the torch.distributed backend the collective uses: the name your collective "
        "library registers with torch.distributed.Backend.register_backend (default gloo, "
        "which moves host tensors)",
    )
    parser.add_argument(
        "--dest", metavar="DIR", default=None, help="directory to write (default: ./mtcore-NAME)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into an existing directory: the skeleton's files are replaced, others kept",
    )


def run(args: argparse.Namespace) -> int:
    try:
        dest = Path(args.dest) if args.dest else Path(f"mtcore-{args.name}")
        files = skeleton(args.name, args.device_type or args.name, args.c10d)
        check_destination(dest, files, args.force)
    except SkeletonError as e:
        print(f"mtcore new-plugin: error: {e}", file=sys.stderr)
        return 2
    try:
        for relative, text in files.items():
            path = dest / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except OSError as e:
        print(f"mtcore new-plugin: error: writing {dest} failed: {e}", file=sys.stderr)
        return 1
    device_type = args.device_type or args.name
    print(f"wrote {dest}/: backend {args.name}, device type {device_type}, c10d {args.c10d}")
    for relative in files:
        print(f"  {relative}")
    print("next: fill in the TODOs (README.md lists them), then")
    print(f"  pip install -e {dest}")
    print(f"  mtcore doctor --backend {args.name}")
    print(f"  pytest {dest / 'tests'}")
    return 0


def skeleton(name: str, device_type: str, c10d: str) -> dict[str, str]:
    """``{relative path: text}`` of the plugin; SkeletonError for a bad argument."""
    from mtcore.cli import plugin_templates

    check_name(name)
    if not NAME.fullmatch(device_type):
        raise SkeletonError(
            f"--device-type {device_type!r} is not a torch device type: lowercase letters, "
            "digits and _, starting with a letter"
        )
    if not C10D.fullmatch(c10d):
        raise SkeletonError(
            f"--c10d {c10d!r} is not a c10d backend name: lowercase letters, digits and _ "
            "(or a device map such as 'cpu:gloo,TYPE:BACKEND')"
        )
    package = f"mtcore_{name}"
    values = {
        "name": name,
        "package": package,
        "dist": f"mtcore-{name}".replace("_", "-"),
        "class_prefix": "".join(part.capitalize() for part in name.split("_")),
        "device_type": device_type,
        "c10d": c10d,
        "mtcore_requirement": mtcore_requirement(),
        "torch_requirement": torch_requirement(),
    }
    return plugin_templates.render(values)


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        hint = f" (did you mean {name.lower().replace('-', '_')!r}?)"
        if not NAME.fullmatch(name.lower().replace("-", "_")):
            hint = ""
        raise SkeletonError(
            f"NAME {name!r} is not a backend name: use lowercase letters, digits and _, "
            f"starting with a letter, since it also names the package mtcore_NAME{hint}"
        )
    if name in BUILT_IN_BACKENDS:
        raise SkeletonError(
            f"NAME {name!r} is mtcore's built-in backend; a plugin that claims it too puts "
            "the name in conflict and neither serves: choose a name of your own"
        )


def check_destination(dest: Path, files: dict[str, str], force: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise SkeletonError(f"{dest} exists and is not a directory")
    if dest.exists() and not force:
        raise SkeletonError(
            f"{dest} already exists; pass --force to write the skeleton into it "
            "(its files are replaced, others kept), or --dest to choose another directory"
        )
    in_the_way = [r for r in files if (dest / r).is_dir()]
    if in_the_way:
        raise SkeletonError(
            f"{dest / in_the_way[0]} is a directory; the skeleton needs a file there"
        )


def mtcore_requirement() -> str:
    """This mtcore's minor release series: the plugin API may change between them."""
    from mtcore import __version__

    major, minor = (int(part) for part in __version__.split(".")[:2])
    return f"mtcore>={major}.{minor},<{major}.{minor + 1}"


def torch_requirement() -> str:
    """The torch range mtcore itself requires (read from its metadata), else the
    installed torch's major release from its minor on."""
    from importlib import metadata

    try:
        requires = metadata.requires("mtcore") or []
    except metadata.PackageNotFoundError:
        requires = []
    for requirement in requires:
        found = re.fullmatch(r"torch\s*([<>=!~][^;]*)", requirement.strip())
        if found and "<" in found.group(1) and ">" in found.group(1):
            bounds = [part.strip() for part in found.group(1).split(",")]
            return "torch" + ",".join(sorted(bounds, key=lambda b: not b.startswith(">")))
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return f"torch>={major}.{minor},<{major + 1}"
