"""What the trainer reports: throughput, TFLOP/s and MFU, memory, and where it goes.

Model FLOPs per step come from the model's family (``FamilyConfig.flops_per_step``,
the no-recompute count that MFU uses: recomputation is not useful work). TFLOP/s
are per rank (F / time / ranks); MFU divides them by
``backend.device.capabilities().peak_tflops`` for the training dtype and is "n/a"
where the peak is not known (the CPU backend states none).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
import yaml


def format_moe(stats: dict[str, float]) -> str:
    """A mixture-of-experts step's load statistics (``Engine``'s ``StepOutcome.moe``)."""
    tokens = [int(v) for k, v in stats.items() if k.startswith("tokens_e")]
    return (
        f"moe load max/mean {stats['load_max']:.2f} (layer avg {stats['load_max_mean']:.2f}) "
        f"min/mean {stats['load_min']:.2f} | dropped {100 * stats['dropped']:.1f}% | "
        f"aux {stats['aux_loss']:.4f} | z {stats['z_loss']:.3f} | tokens/expert {tokens}"
    )


def peak_tflops(backend, dtype: torch.dtype) -> float | None:
    """The device's dense peak for ``dtype`` (TFLOP/s), or None when unknown."""
    try:
        peaks = backend.device.capabilities().peak_tflops
    except Exception:  # a device that cannot describe itself has no known peak
        return None
    return peaks.get(str(dtype).removeprefix("torch.")) or None


def format_mfu(tflops_per_rank: float, peak: float | None) -> str:
    return "n/a" if not peak else f"{100 * tflops_per_rank / peak:.1f}%"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class Progress:
    """Rank 0's console output: a bar redrawn in place on a terminal, plain lines otherwise.

    ``line`` prints a permanent line (log intervals, evaluations, warnings);
    ``update`` redraws the bar (terminal only). The bar never hides a line: it is
    cleared before each permanent line and drawn again after it.
    """

    def __init__(self, total: int, mode: str = "auto", stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.total = total
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = mode == "bar" or (mode == "auto" and tty)
        self._last = ""
        self._start = time.perf_counter()

    def update(self, step: int, text: str) -> None:
        if not self.bar:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(step, 1) * (self.total - step)
        self._last = (
            f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {text} | "
            f"eta {_clock(eta)}"
        )
        self.stream.write("\r\033[K" + self._last)
        self.stream.flush()

    def line(self, text: str) -> None:
        if self.bar and self._last:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        if self.bar and self._last:
            self.stream.write(self._last)
        self.stream.flush()

    def close(self) -> None:
        if self.bar and self._last:
            self.stream.write("\n")
            self.stream.flush()
            self._last = ""


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


class Scalars:
    """Where the scalars go: TensorBoard event files (``torch.utils.tensorboard``) when
    ``log_dir`` is set, and a Weights & Biases run when ``wandb`` is; nothing otherwise.

    ``config`` (the run's whole config, as plain data) goes to both when the writer
    opens: TensorBoard's text tab as YAML, W&B's run config, so every curve carries
    the settings that made it.
    """

    def __init__(self, log_dir: str | None, config: dict | None = None, wandb: dict | None = None):
        self.writer = None
        self.wandb_run = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(log_dir)
            if config is not None:
                text = yaml.safe_dump(config, sort_keys=False)
                # Indented: TensorBoard renders text as markdown, and this keeps it verbatim.
                self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
        if wandb is not None:
            import wandb as wandb_lib  # mtcore[wandb]; checked before the job starts

            Path(wandb["dir"]).mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb_lib.init(config=config, **wandb)

    def add(self, step: int, values: dict[str, float | None]) -> None:
        finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        if self.writer is not None:
            for tag, value in finite.items():
                self.writer.add_scalar(tag, value, step)
        if self.wandb_run is not None and finite:
            self.wandb_run.log(finite, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
