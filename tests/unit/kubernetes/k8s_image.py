"""What can be checked of examples/kubernetes/Containerfile without building it (there is
no container engine here): its instructions, what it copies from the build context (the
repository root), what it installs, the base image's torch, and the ENTRYPOINT, CMD and
tag the manifests rely on."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from k8s_cluster import ROOT, Image
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

CONTAINERFILE = ROOT / "examples" / "kubernetes" / "Containerfile"
# torch >= 2.9: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, the agent's wait for the ranks' save.
TORCH_FOR_SHUTDOWN_TIMEOUT = Version("2.9")


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def repo_distributions() -> dict[str, Path]:
    """The distributions this repository builds: name -> project directory."""
    found = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


def image(text: str) -> Image:
    """The ENTRYPOINT, CMD, WORKDIR and the tag its build comment gives (-t TAG)."""
    found = {keyword: rest for keyword, rest in instructions(text)}
    tag = re.search(r"build .*-t (\S+)", text)
    return Image(
        entrypoint=json.loads(found.get("ENTRYPOINT", "[]")),
        cmd=json.loads(found.get("CMD", "[]")),
        tag=tag.group(1) if tag else "",
        workdir=found.get("WORKDIR", "/"),
    )


def problems(text: str) -> list[str]:
    """What in the Containerfile cannot work against this repository."""
    out = []
    steps = instructions(text)
    args = dict(rest.split("=", 1) for keyword, rest in steps if keyword == "ARG" and "=" in rest)
    workdir = Path("/")
    copied: dict[Path, Path] = {}  # path in the image -> path in the repository
    for keyword, rest in steps:
        if keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword == "COPY":
            *sources, dest = shlex.split(rest)
            for source in sources:
                if not (ROOT / source).exists():
                    out.append(f"COPY {source}: no such path in the build context")
                target = workdir / dest
                copied[target / Path(source).name if dest.endswith("/") else target] = ROOT / source
        elif keyword == "RUN" and "pip install" in rest:
            out += _install_problems(rest, workdir, copied)
    entrypoint = image(text).entrypoint
    installs = " ".join(rest for keyword, rest in steps if keyword == "RUN")
    if not entrypoint or Path(entrypoint[0]).name not in installs.split():
        out.append(f"ENTRYPOINT {entrypoint}: its program is installed by no RUN")
    out += _base_problems(args.get("BASE_IMAGE", ""))
    return out


def _install_problems(run: str, workdir: Path, copied: dict[Path, Path]) -> list[str]:
    out = []
    words = shlex.split(run.split("pip install", 1)[1].split("&&")[0])
    targets = [word for word in words if not word.startswith("-")]
    installed: dict[str, set[str]] = {}
    distributions = repo_distributions()
    for target in targets:
        path, _, extras = target.partition("[")
        source = _copied_project(workdir / path, copied)
        if source is None:
            out.append(f"pip install {target}: not a project copied into the image")
            continue
        name = tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"]
        if distributions.get(name) != source:
            out.append(f"pip install {target}: {name} is not a distribution of this repository")
        installed[name] = set(filter(None, extras.rstrip("]").split(",")))
    if "mtcore" not in installed or not {"mtcore-cuda", "mtcore-musa"} & set(installed):
        out.append(f"pip install installs {sorted(installed)}: mtcore and a backend plugin needed")
    for name, extras in installed.items():
        project = tomllib.loads((distributions[name] / "pyproject.toml").read_text())["project"]
        optional = project.get("optional-dependencies", {})
        for extra in extras:
            if extra not in optional:
                out.append(f"{name}[{extra}]: no such extra")
                continue
            for requirement in map(Requirement, optional[extra]):
                # This repository's distributions are on no index: their paths must be installed.
                if requirement.name in distributions and requirement.name not in installed:
                    out.append(f"{name}[{extra}] needs {requirement.name}, which is on no index")
    return out


def _copied_project(directory: Path, copied: dict[Path, Path]) -> Path | None:
    """The repository project that ``directory`` holds in the image: copied whole, or as
    its pyproject.toml, readme and package roots (setuptools' packages.find.where)."""
    if directory in copied:
        source = copied[directory]
        return source if (source / "pyproject.toml").is_file() else None
    pyproject = copied.get(directory / "pyproject.toml")
    if pyproject is None:
        return None
    config = tomllib.loads(pyproject.read_text())
    readme = config["project"].get("readme")
    where = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    needed = ([readme] if isinstance(readme, str) else []) + where.get("where", ["."])
    parts = [copied.get(directory / part) == pyproject.parent / part for part in needed]
    return pyproject.parent if all(parts) else None


def _base_problems(base: str) -> list[str]:
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    if match is None:
        return [f"BASE_IMAGE {base!r}: not a PyTorch CUDA runtime image with a torch version"]
    torch = Version(match.group(1))
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = next(Requirement(r) for r in core if Requirement(r).name == "torch")
    out = []
    if torch not in wanted.specifier:
        out.append(f"BASE_IMAGE torch {torch} is outside mtcore's {wanted}")
    if torch < TORCH_FOR_SHUTDOWN_TIMEOUT:
        out.append(f"BASE_IMAGE torch {torch} ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT (2.9+)")
    return out
