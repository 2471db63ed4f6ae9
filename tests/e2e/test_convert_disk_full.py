"""A disk that fills up under `mtcore convert` from-megatron, to-megatron (both formats)
and from-hf: one line, exit 1, and nothing left behind, neither a partial ``iter_N`` or
``step_N`` nor the directories the command created, so "nothing was written" is true.

The full disk is real: a 64 KiB tmpfs mounted in a mount namespace of the test's own
(``unshare -m``, root), else a file-size limit (RLIMIT_FSIZE: writes past it fail with
EFBIG) on the converting process. One process converts every case (torch loads once).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from mtcore.cli.main import main
from mtcore.models.gpt import GPTConfig, full_weight_shapes
from mtcore.training.checkpoint import write_model_weights

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   seq_len=8)  # fmt: skip
LIMIT = 64 * 1024  # the weights file alone is about 170 KiB

CONVERT_ALL = """
import contextlib, io, json, os, sys
from mtcore.cli.main import main

full, cases = sys.argv[1], json.loads(sys.argv[2])
os.makedirs(os.path.join(full, "kept"), exist_ok=True)  # an OUT_ROOT holding something else
seen = []
for argv in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except BaseException as e:  # what the console script would print as a traceback
            code = f"raised {type(e).__name__}"
    left = sorted(os.path.relpath(os.path.join(d, n), full)
                  for d, dirs, files in os.walk(full) for n in dirs + files)
    seen.append((code, err.getvalue(), left))
print(json.dumps(seen))
"""


def _full_disk_command(full: Path) -> tuple[list[str], object]:
    """The command prefix and preexec function that run Python against a full ``full``."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("mount"):
        mount = f'mount -t tmpfs -o size={LIMIT} tmpfs {full} && exec "$0" "$@"'
        return ["unshare", "-m", "sh", "-c", mount, sys.executable], None

    def limit_file_size():
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )

    return [sys.executable], limit_file_size


def test_a_full_disk_leaves_nothing_and_says_so_in_one_line(tmp_path, cli_env, capsys):
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) for n, s in full_weight_shapes(CONFIG).items()}
    ours = tmp_path / "mtcore"
    write_model_weights(ours, weights, CONFIG, step=3)
    sources = {}
    for direction, flags in (("to-megatron", []), ("to-megatron", ["--format", "torch_dist"]),
                             ("to-hf", [])):  # fmt: skip
        sources[(direction, *flags)] = tmp_path / f"{direction}{len(flags)}"
        assert (
            main(["convert", direction, str(ours), str(sources[(direction, *flags)]), *flags]) == 0
        )
    capsys.readouterr()
    full = tmp_path / "full"
    full.mkdir()
    cases = [
        ["convert", "from-megatron", str(sources[("to-megatron",)]), str(full / "a" / "b")],
        ["convert", "from-megatron", str(sources[("to-megatron", "--format", "torch_dist")]),
         str(full / "kept")],
        ["convert", "to-megatron", str(ours), str(full / "legacy")],
        ["convert", "to-megatron", str(ours), str(full / "new" / "dist"), "--format", "torch_dist"],
        ["convert", "from-hf", str(sources[("to-hf",)]), str(full / "hf")],
        ["convert", "from-hf", str(sources[("to-hf",)]), str(full / "kept")],
    ]  # fmt: skip
    prefix, preexec = _full_disk_command(full)
    done = subprocess.run([*prefix, "-c", CONVERT_ALL, str(full), json.dumps(cases)],
                          capture_output=True, text=True, env=cli_env(), preexec_fn=preexec,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for argv, (code, err, left) in zip(cases, json.loads(done.stdout), strict=True):
        assert code == 1, (argv, code, err)
        assert err.count("\n") == 1 and "nothing was written" in err, (argv, err)
        assert f"cannot write {argv[3]}" in err, err
        assert left == ["kept"], (argv, left)  # neither a partial step nor a staging folder
