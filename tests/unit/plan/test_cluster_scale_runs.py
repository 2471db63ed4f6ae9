"""docs/plan.md's "Published layouts at cluster scale": its two commands run as written,
and the table beside them holds what they predict (model TFLOP/s for Llama 3 405B,
tokens/s per GPU for DeepSeek-V3), its error against the published figure and its
peak memory. A planner change that moves either fails here until the table is redone."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from mtcore.cli.main import main

DOC = Path(__file__).resolve().parents[3] / "docs" / "plan.md"
RUNS = {  # the command's distinguishing text -> (table row start, metric, published)
    "--gpus 16384 --hardware docs/examples/hardware/h100-meta-roce.toml": (
        "| Llama 3 405B, 16,384 H100", "model_tflops_per_gpu", 400.0),
    "--gpus 2048 --hardware docs/examples/hardware/h800-deepseek.toml": (
        "| DeepSeek-V3 671B", "tokens_per_gpu", 1543.0),
}  # fmt: skip


def documented_command(marker: str) -> list[str]:
    text = DOC.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        if marker in joined:
            return shlex.split(joined)[1:]  # without "mtcore"
    raise AssertionError(f"no command with {marker!r} in {DOC}")


def test_the_table_holds_what_the_commands_predict(capsys):
    text = DOC.read_text()
    for marker, (row_start, metric, published) in RUNS.items():
        assert main([*documented_command(marker), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        result["tokens_per_gpu"] = result["tokens_per_s"] / result["gpus"]
        predicted = result[metric]
        row = next(line for line in text.splitlines() if line.startswith(row_start))
        shown = f"{predicted:.1f}" if metric == "model_tflops_per_gpu" else f"{predicted:.0f}"
        assert shown in row, (row_start, shown)
        assert f"({predicted / published - 1:+.0%})" in row or (
            f"({predicted / published - 1:+.1%})" in row
        ), row_start
        memory = result["memory"]
        assert memory["fits"] and f"{memory['peak_bytes'] / 1e9:.1f} of 80 GB" in row, row_start
