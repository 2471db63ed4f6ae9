"""What a finished training run left behind, read back for comparison with another run.

Tests and benchmarks that start ``mtcore train`` as a process (on one host, on
namespace nodes, under Slurm) compare it with a reference run by what a user
can see: the losses rank 0 wrote to TensorBoard (full float precision; the
printed ones have four decimals), the step lines it printed, and the weights
of its checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss ([0-9.]+|nan|inf)", re.MULTILINE)


def short_run(directory: str | Path, cache: str | Path, steps: int) -> list[str]:
    """Overrides that shorten a job (the default one, say) to ``steps`` steps, every one
    logged to TensorBoard under ``directory`` and committed (``checkpoint.dir`` is left to
    the caller), no evaluation and no sample, the data cached under ``cache``."""
    return [
        "--training.steps", str(steps), "--training.eval_interval", "0",
        "--training.sample_prompt", "null", "--logging.interval", "1",
        "--logging.tensorboard_dir", str(Path(directory) / "tensorboard"),
        "--checkpoint.interval", "1", "--data.cache_dir", str(cache),
    ]  # fmt: skip


def printed_losses(text: str) -> dict[int, str]:
    """Step -> the loss as printed (``step 3/8 | loss 7.7044 | ...`` lines)."""
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(text)}


def tensorboard_scalars(directory: str | Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """Every ``(step, value)`` of ``tag`` in the event files under ``directory``, in the order
    written (files by name, which starts with their creation time): a step trained twice
    (before and after a restart) appears twice."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    found.append((event.step, _scalar(value)))
    return found


def _scalar(value) -> float:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    from tensorboard.util import tensor_util

    return float(tensor_util.make_ndarray(value.tensor))


def by_step(scalars: list[tuple[int, float]]) -> dict[int, float]:
    """Step -> value; a ValueError names a step logged twice with different values (a
    restarted run that did not redo it exactly)."""
    out: dict[int, float] = {}
    for step, value in scalars:
        if step in out and out[step] != value:
            raise ValueError(
                f"step {step} was logged twice with different values: {out[step]} and {value}"
            )
        out[step] = value
    return out


def weight_differences(a: str | Path, b: str | Path) -> list[str]:
    """The names of the model weights that differ (bit for bit, or in shape, dtype or
    presence) between the checkpoints ``a`` and ``b`` (roots or step directories);
    an empty list when they are identical."""
    from mtcore.training.checkpoint import read_model_weights

    _, first, _ = read_model_weights(a)
    _, second, _ = read_model_weights(b)
    differ = sorted(set(first) ^ set(second))
    for name in sorted(set(first) & set(second)):
        x, y = first[name], second[name]
        if x.shape != y.shape or x.dtype != y.dtype or not x.equal(y):
            differ.append(name)
    return differ
