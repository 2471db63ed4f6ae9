"""Installing the out-of-tree examples under docs/examples as a user would.

``install_example("mtcore-example-plugin")`` pip-installs a copy of that example (or
of the distribution at an absolute path, such as a generated skeleton) into a --target
directory of its own; ``InstalledExample.run`` starts Python with that
directory on PYTHONPATH, so the example reaches the subprocesses (and every rank
they launch) while the environment of the test run is left untouched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
MTCORE_ENV = (
    "MTCORE_BACKEND",
    "MTCORE_PLUGINS",
    "MTCORE_DISABLE_PLUGIN_AUTOLOAD",
    "MTCORE_KERNELS",
)


def can_build_offline() -> bool:
    """Whether this environment's setuptools can build a wheel without fetching anything.

    torch depends on setuptools, so the project's venv has a recent one; bdist_wheel is
    built into setuptools from 70.1 on, and needs the ``wheel`` package before that.
    """
    try:
        import setuptools
    except ImportError:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@dataclass(frozen=True)
class InstalledExample:
    """An example distribution installed into ``path`` (a pip --target directory)."""

    path: Path

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
        """``python *args`` with the example importable and no MTCORE_* selection set."""
        full = {k: v for k, v in os.environ.items() if k not in MTCORE_ENV}
        pythonpath = [str(self.path), os.environ.get("PYTHONPATH")]
        full["PYTHONPATH"] = os.pathsep.join(filter(None, pythonpath))
        full.update(env or {})
        return subprocess.run(
            [sys.executable, *map(str, args)],
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="session")
def install_example(tmp_path_factory):
    """``install(name) -> InstalledExample``: pip-install docs/examples/<name>, or the
    distribution at ``name`` when it is an absolute path (offline when setuptools allows)."""

    def install(name: str | Path) -> InstalledExample:
        origin = EXAMPLES / name  # an absolute path stays itself
        name = origin.name
        tmp = tmp_path_factory.mktemp(name)
        # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
        source = tmp / "src"
        shutil.copytree(
            origin,
            source,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
        )
        target = tmp / "site"
        isolation = ["--no-build-isolation"] if can_build_offline() else []
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                *isolation,
                "--no-input",
                "--disable-pip-version-check",
                "--target",
                str(target),
                str(source),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, (
            f"pip install of {name} failed:\n{result.stdout}\n{result.stderr}"
        )
        return InstalledExample(target)

    return install


@pytest.fixture(scope="session")
def install_throwaway_plugin(tmp_path_factory, install_example):
    """``install(dist, files, entry_points) -> InstalledExample``: write a plugin
    distribution that exists only for one test and pip-install it like an example.

    ``files`` maps paths inside the distribution (``"pkg/__init__.py"``) to their
    source; ``entry_points`` maps ``mtcore.plugins`` entry point names to modules.
    Each distribution is generated in a tmp dir, so bad plugins need no folder
    under docs/examples.
    """

    def install(dist: str, files: dict[str, str], entry_points: dict[str, str]):
        source = tmp_path_factory.mktemp("generated") / dist
        for relpath, text in files.items():
            path = source / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        packages = sorted({Path(p).parent.as_posix().replace("/", ".") for p in files if "/" in p})
        lines = [
            "[build-system]",
            'requires = ["setuptools>=61"]',
            'build-backend = "setuptools.build_meta"',
            "[project]",
            f'name = "{dist}"',
            'version = "0.1.0"',
            '[project.entry-points."mtcore.plugins"]',
            *(f'{name} = "{module}"' for name, module in entry_points.items()),
            "[tool.setuptools]",
            f"packages = {json.dumps(packages)}",
        ]
        (source / "pyproject.toml").write_text("\n".join(lines) + "\n")
        return install_example(source)

    return install
