"""Text tables for ``mtcore plan``: one layout in detail, or several side by side."""

from __future__ import annotations

from mtcore.plan.planner import Plan

GB = 1e9


def size(nbytes: float) -> str:
    """Bytes in GB, or MB below one GB (toy models on this machine are megabytes)."""
    if nbytes >= GB:
        return f"{nbytes / GB:8.2f} GB"
    return f"{nbytes / 1e6:8.2f} MB"


def _layout_line(p: Plan) -> str:
    lay = p.layout
    parts = [f"tp{lay['tp']}", f"cp{lay['cp']}", f"pp{lay['pp']}", f"dp{lay['dp']}"]
    if lay["vpp"] > 1:
        parts.append(f"vpp{lay['vpp']}")
    if lay["ep"] > 1:
        parts.append(f"ep{lay['ep']}")
    if lay.get("first_stage_layers") is not None or lay.get("last_stage_layers") is not None:
        parts.append(f"layers {p.assumed.get('stage layers', '?').replace(' ', '')}")
    if lay["sequence_parallel"]:
        parts.append("sp")
    zero = lay.get("zero", int(lay["zero1"]))
    if zero:
        parts.append(f"zero{zero}")
    parts.append(f"mb{lay['micro_batch']}")
    parts.append(f"recompute={lay['recompute']}")
    return " ".join(parts)


def describe(p: Plan) -> str:
    """One layout: memory of the fullest pipeline rank, then the step's time by cause."""
    r = p.peak_rank
    t = p.time
    fit = "fits" if p.fits else "DOES NOT FIT"
    lines = [
        f"{p.family} {p.params / 1e9:.2f}B params on {p.gpus} x {p.hardware}: {_layout_line(p)}",
        f"  {p.microbatches} micro-batches per step and dp rank",
        f"memory per rank (pipeline stage {r.stage}, the fullest of {len(p.ranks)}):",
        f"  parameters       {r.params / 1e6:12.1f} M dense  {r.expert_params / 1e6:10.1f} M experts",
        f"  weights          {size(r.weights)}",
        f"  gradients        {size(r.grads)}  ({p.assumed.get('grad reduce dtype', 'fp32')} buffers)",
        f"  master weights   {size(r.master)}",
        f"  optimizer state  {size(r.optimizer)}  (AdamW moments{_zero(p)})",
        f"  activations      {size(r.activations)}  ({r.in_flight:g} micro-batches in flight)",
        f"  transient        {size(r.transient)}  (backward start, loss and head, recompute)",
        f"  peak             {size(r.peak)}  of {size(p.memory_limit).strip()}: {fit}",
        "step time:",
    ]
    rows = [
        ("compute", t.compute),
        ("recompute", t.recompute),
        ("memory-bound", t.memory_bound),
        ("tp comm (exposed)", t.tp_comm),
        ("cp comm (exposed)", t.cp_comm),
        ("ep comm (exposed)", t.ep_comm),
        ("pp p2p", t.pp_comm),
        ("pipeline bubble", t.bubble),
        (f"dp reduction (exposed of {t.dp_comm * 1e3:.1f} ms)", t.dp_exposed),
        ("tied embedding grad", t.tied_comm),
        ("optimizer step", t.optimizer),
    ]
    if t.overhead:  # named only where the hardware file gives the software's fixed cost
        rows.append(("software overhead", t.overhead))
    for name, seconds in rows:
        lines.append(f"  {name:34s} {seconds * 1e3:12.2f} ms  {seconds / t.total:6.1%}")
    lines += [
        f"  {'total':34s} {t.total * 1e3:12.2f} ms",
        f"tokens/s {p.tokens_per_s:,.0f}   TFLOP/s per accelerator {p.tflops_per_gpu:.4g} "
        f"(model {p.model_tflops_per_gpu:.4g})   MFU {p.mfu:.1%}",
    ]
    lines.append("assumed: " + ", ".join(f"{k} {v}" for k, v in p.assumed.items()))
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _zero(p: Plan) -> str:
    zero = p.layout.get("zero", int(p.layout["zero1"]))
    return f", ZeRO-{zero}" if zero else ""


def side_by_side(names: list[str], plans: list[Plan | str]) -> str:
    """Several layouts in columns; a column that is a string is the trainer's refusal."""
    rows = [
        ("layout", lambda p: _layout_line(p)),
        ("peak memory", lambda p: size(p.peak_memory).strip() + ("" if p.fits else " (too big)")),
        ("activations", lambda p: size(p.peak_rank.activations).strip()),
        ("step ms", lambda p: f"{p.time.total * 1e3:.1f}"),
        ("bubble ms", lambda p: f"{p.time.bubble * 1e3:.1f}"),
        ("exposed comm ms", lambda p: f"{p.time.exposed_comm * 1e3:.1f}"),
        ("recompute ms", lambda p: f"{p.time.recompute * 1e3:.1f}"),
        ("tokens/s", lambda p: f"{p.tokens_per_s:,.0f}"),
        ("TFLOP/s per accel", lambda p: f"{p.tflops_per_gpu:.4g}"),
        ("MFU", lambda p: f"{p.mfu:.1%}"),
        *((f"assumed {key}", _assumed(key)) for key in _ASSUMED),
    ]
    table = [["", *names]]
    for label, cell in rows:
        table.append([label] + [cell(p) if isinstance(p, Plan) else "-" for p in plans])
    refusals = [
        f"{n}: rejected: {p}" for n, p in zip(names, plans, strict=True) if isinstance(p, str)
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    text = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table
    )
    return "\n".join([text, *refusals])


_ASSUMED = ("flash attention", "comm overlap", "dp overlap", "grad reduce dtype", "zero")


def _assumed(key: str):
    return lambda p: p.assumed.get(key, "-")
