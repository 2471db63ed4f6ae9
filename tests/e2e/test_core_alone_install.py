"""``pip install mtcore`` alone, with no plugin, trains the default job on CPU.

The core ships the host ``cpu`` backend itself (``mtcore.backend.host``), so a fresh
virtual environment with only the core distribution, built from the tracked
sources as a wheel (not an editable install), must list one plugin and train.
Slow: it creates a venv and installs torch into it (from this machine's disk).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "src")

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH="")
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_core_alone_lists_only_itself_and_trains_the_default_job(tmp_path):
    source = tmp_path / "mtcore-src"
    source.mkdir()
    for name in SOURCES:  # copy, so the build writes nothing into the checkout
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), str(source)], tmp_path)

    listing = json.loads(run([str(venv / "bin" / "mtcore"), "plugins", "--json"], tmp_path).stdout)
    assert [p["name"] for p in listing["plugins"]] == ["mtcore"]
    assert listing["plugins"][0]["backends"] == ["cpu"]

    job = tmp_path / "job"
    job.mkdir()
    shutil.copy2(REPO / "configs" / "default.yaml", job / "default.yaml")
    result = run(
        [str(venv / "bin" / "mtcore"), "train", "default.yaml", "--nproc", "4", "--training.steps", "3",
         "--logging.interval", "1", "--training.sample_tokens", "0"],
        job,
    )
    out = result.stdout
    assert "on cpu" in out and "tp=2 pp=2" in out
    assert "step 3/3 | loss" in out, out[-2000:]
    assert "warning: automatic backend selection" not in out  # no accelerator plugin installed
    assert (job / "runs" / "default" / "checkpoints").is_dir()
