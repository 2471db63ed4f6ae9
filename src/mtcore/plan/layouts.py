"""Layout strings: ``tp=2,pp=2,vpp=2,mb=2,sp,zero1,recompute=full`` -> config overrides.

``mtcore plan --compare`` and ``mtcore sweep --layouts`` take layouts in this form;
each key is one ``--section.key VALUE`` override of the training config, so a
layout is checked by exactly the validators ``mtcore train`` runs. ``mtcore plan
--compare`` also takes the planner's software assumptions (``OPTION_KEYS``: the
``Options`` of ``mtcore.plan.options``), which no training run has: ``zero=3``,
``flash=off``, ``overlap=tp+pp``, ``grad_dtype=bf16``, ``dp_overlap=full``,
``cross_node``, ``recompute_modules=layernorm+moe_act``, ``moe_dispatch=fp8``,
``moe_probs=expert``, ``order=tp-cp-pp-dp``, ``reshard=off``, ``reduce=step``,
``prefetch=2``. ``zero`` 0-2 is both: the stage ``mtcore train`` runs
(``parallel.zero``) and the planner's assumption for that column.
"""

from __future__ import annotations

from mtcore.plan.data_parallel import FSDP_REDUCE
from mtcore.plan.network import RANK_ORDERS
from mtcore.plan.options import DP_OVERLAP, GRAD_DTYPES, MOE_DISPATCH, MOE_PROBS

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
    "first": "parallel.first_stage_layers",
    "last": "parallel.last_stage_layers",
    "mb": "training.micro_batch_size",
    "gb": "training.global_batch_size",
    "recompute": "model.recompute",
    "dtype": "precision.dtype",
}
OPTION_KEYS = {
    "zero": "zero",
    "flash": "fused_attention",
    "overlap": "overlapped",
    "grad_dtype": "grad_reduce_dtype",
    "dp_overlap": "dp_overlap",
    "cross_node": "cross_node",
    "recompute_modules": "recompute_modules",
    "moe_dispatch": "moe_dispatch",
    "moe_probs": "moe_probs",
    "order": "rank_order",
    "reshard": "fsdp_reshard",
    "reduce": "fsdp_reduce",
    "prefetch": "fsdp_prefetch",
    "fp8_experts": "fp8_experts",
    "node_limit": "moe_node_limit",
}
TRAINED_ZERO = (0, 1, 2)  # the ZeRO stages mtcore train runs (parallel.zero)
FLAGS = {"sp", "zero1", "cross_node", "fp8_experts"}  # given bare, they mean true
_ON = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
_CHOICES = {
    "dp_overlap": DP_OVERLAP,
    "grad_reduce_dtype": tuple(GRAD_DTYPES),
    "moe_dispatch": MOE_DISPATCH,
    "moe_probs": MOE_PROBS,
    "rank_order": RANK_ORDERS,
    "fsdp_reduce": FSDP_REDUCE,
}


class LayoutStringError(ValueError):
    """A layout string with an unknown key or a missing value."""


def option_value(key: str, value: str):
    """A planner option's value from its text: ``zero`` a stage number, ``flash`` and
    ``cross_node`` on/off, ``overlap`` axes joined by ``+`` (or ``none``)."""
    field = OPTION_KEYS[key]
    if field == "zero":
        if not (value.isascii() and value.isdigit()):
            raise LayoutStringError(f"zero={value!r}: give a ZeRO stage 0, 1, 2 or 3")
        return int(value)
    if field in ("fsdp_prefetch", "moe_node_limit"):
        if not (value.isascii() and value.isdigit()):
            raise LayoutStringError(f"{key}={value!r}: give a whole number >= 0")
        return int(value)
    if field in ("fused_attention", "cross_node", "fsdp_reshard", "fp8_experts"):
        if value.lower() not in _ON:
            raise LayoutStringError(f"{key}={value!r}: give on or off")
        return _ON[value.lower()]
    if field in ("overlapped", "recompute_modules"):
        return () if value == "none" else tuple(filter(None, value.replace("+", ",").split(",")))
    choices = _CHOICES.get(field)
    if choices is not None and value not in choices:
        raise LayoutStringError(f"{key}={value!r}: give one of {', '.join(choices)}")
    return value


def parse_layout(text: str) -> tuple[list[str], dict]:
    """``"tp=2,pp=2,sp,zero=3"`` -> (config overrides ``["--parallel.tp", "2", ...]``,
    planner option updates ``{"zero": 3}``); ``x`` is accepted for ``=``-less sizes
    (``tp2``)."""
    out: list[str] = []
    options: dict = {}
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
        if key in OPTION_KEYS:
            options[OPTION_KEYS[key]] = option_value(key, value)
            if key == "zero" and options["zero"] in TRAINED_ZERO:
                out += ["--parallel.zero", value]
        elif key in KEYS:
            out += [f"--{KEYS[key]}", value]
        else:
            raise LayoutStringError(_unknown(part))
    return out, options


def layout_overrides(text: str) -> list[str]:
    """The config overrides of a layout that ``mtcore train`` runs (no planner options)."""
    overrides, options = parse_layout(text)
    if options.get("zero") in TRAINED_ZERO:
        del options["zero"]  # carried by --parallel.zero
    if options:
        names = ", ".join(k for k, v in OPTION_KEYS.items() if v in options)
        raise LayoutStringError(
            f"layout {text!r}: {names} is a planner assumption (mtcore plan --compare), "
            "not a setting mtcore train runs"
        )
    return overrides


def _unknown(part: str) -> str:
    keys = ", ".join([*KEYS, *OPTION_KEYS])
    return f"layout {part!r}: use key=value with keys {keys} (e.g. tp=2,pp=2,mb=2,sp,zero1)"
