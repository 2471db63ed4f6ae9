"""Layout strings: ``tp=2,pp=2,vpp=2,mb=2,sp,zero1,recompute=full`` -> config overrides.

``mtcore plan --compare`` and ``mtcore sweep --layouts`` take layouts in this form;
each key is one ``--section.key VALUE`` override of the training config, so a
layout is checked by exactly the validators ``mtcore train`` runs.
"""

from __future__ import annotations

KEYS = {
    "tp": "parallel.tp",
    "cp": "parallel.cp",
    "pp": "parallel.pp",
    "vpp": "parallel.vpp",
    "dp": "parallel.dp",
    "ep": "parallel.ep",
    "sp": "parallel.sequence_parallel",
    "zero1": "parallel.zero1",
    "schedule": "parallel.schedule",
    "cp_method": "parallel.cp_method",
    "mb": "training.micro_batch_size",
    "gb": "training.global_batch_size",
    "recompute": "model.recompute",
    "dtype": "precision.dtype",
}
FLAGS = {"sp", "zero1"}  # given bare, they mean true


class LayoutStringError(ValueError):
    """A layout string with an unknown key or a missing value."""


def layout_overrides(text: str) -> list[str]:
    """``"tp=2,pp=2,sp"`` -> ``["--parallel.tp", "2", "--parallel.pp", "2",
    "--parallel.sequence_parallel", "true"]``; ``x`` is accepted for ``=``-less sizes
    (``tp2``)."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            stripped = key.rstrip("0123456789")
            if key in FLAGS:
                value = "true"
            elif stripped in KEYS and stripped != key:
                key, value = stripped, key[len(stripped) :]
            else:
                raise LayoutStringError(_unknown(part))
        if key not in KEYS:
            raise LayoutStringError(_unknown(part))
        out += [f"--{KEYS[key]}", value]
    return out


def _unknown(part: str) -> str:
    return (
        f"layout {part!r}: use key=value with keys {', '.join(KEYS)} (e.g. tp=2,pp=2,mb=2,sp,zero1)"
    )
