"""Checking full weights against a family's shapes, and loading them into a chunk.

"Full weights" are a family's one-process ``state_dict``: whole tensors under the
whole model's names (each family's ``weights.py`` says which names and shapes).
Comparing a set of them with the shapes a config implies, and copying a rank's
shard of them into one of its pipeline chunks, do not depend on the family, so
every family that uses mtcore's layers (GPT, BERT, T5, LLaVA) does it here and their
errors read alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from mtcore.parallel.tensor import load_full_tensors


def check_weight_shapes(
    shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, Tensor], what: str
) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor of
    ``weights`` against ``shapes`` (name -> shape); ``what`` names the weights."""
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(set(weights) - set(shapes))
    problems = []
    if missing:
        problems.append(f"missing {few(missing)}")
    if unexpected:
        problems.append(f"unexpected {few(unexpected)}")
    problems += [
        f"{name} is {list(weights[name].shape)}, expected {list(shape)}"
        for name, shape in shapes.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    if problems:
        raise ValueError(f"{what} do not fit the model config: " + "; ".join(problems))


def load_chunk_weights(chunk: nn.Module, source: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard of every parameter of ``chunk`` from ``source`` (full
    weights, with the chunk's tied copies already filled in by the family)."""
    needed = {name for name, _ in chunk.named_parameters()}
    missing = sorted(needed - set(source))
    if missing:
        raise ValueError(f"the full weights lack {few(missing)} for this chunk")
    load_full_tensors(chunk, {name: source[name] for name in needed}, chunk.tp)


def few(names: list[str], limit: int = 6) -> str:
    """The first ``limit`` of ``names``, and how many more there are."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
