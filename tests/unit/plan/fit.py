"""Refit the planner's two efficiency constants on the two rows named in published.FITTED,
and print every published row against the model (predicted, published, error).

    .venv/bin/python tests/unit/plan/fit.py

A grid search over (GEMM_EFFICIENCY, LINK_EFFICIENCY) minimising the squared relative
error of those two rows only; it prints the pair and every row's error (the other rows,
the Megatron-Core H100 ones and the held-out runs of held_out.py included, are
predictions). Copy the pair into
src/mtcore/plan/constants.py.
"""

from __future__ import annotations

from held_out import HELD_OUT
from published import (
    FITTED,
    MEGATRON_CORE_2024,
    NARAYANAN_2021,
    megatron_core_config,
    narayanan_config,
)
from test_published_rows import MEGATRON_2021, MEGATRON_CORE, core_micro_batch

from mtcore.plan import constants, load_hardware, plan


def narayanan_tflops(name: str, rows: dict, configs: dict, hardware) -> float:
    r = rows[name]
    return plan(configs[name], r[6], hardware, MEGATRON_2021).tflops_per_gpu


def main() -> None:
    a100 = load_hardware("A100-80GB")
    rows = {r[0]: r for r in NARAYANAN_2021}
    configs = {name: narayanan_config(*r[1:8]) for name, r in rows.items()}

    def error(name: str) -> float:
        return narayanan_tflops(name, rows, configs, a100) / rows[name][8] - 1

    best = None
    for gemm in (x / 100 for x in range(50, 100)):
        for link in (x / 100 for x in range(30, 101, 2)):
            constants.GEMM_EFFICIENCY, constants.LINK_EFFICIENCY = gemm, link
            loss = sum(error(name) ** 2 for name in FITTED)
            if best is None or loss < best[0]:
                best = (loss, gemm, link)
    _, constants.GEMM_EFFICIENCY, constants.LINK_EFFICIENCY = best
    print(f"GEMM_EFFICIENCY = {best[1]:.2f}\nLINK_EFFICIENCY = {best[2]:.2f}")
    print(f"{'row':34s} {'predicted':>9s} {'published':>9s} {'error':>7s}")
    for label, predicted, published, tag in every_row():
        _print_row(label, predicted, published, tag)


def every_row():
    """(label, predicted, published, tag) of every published and held-out row under the
    planner's current constants, in docs/plan.md's order."""
    a100, h100 = load_hardware("A100-80GB"), load_hardware("H100-SXM")
    rows = {r[0]: r for r in NARAYANAN_2021}
    configs = {name: narayanan_config(*r[1:8]) for name, r in rows.items()}
    for name, r in rows.items():
        tag = "fitted" if name in FITTED else "predicted"
        predicted = narayanan_tflops(name, rows, configs, a100)
        yield "Narayanan 2021 " + name, predicted, r[8], tag
    for name, hidden, layers, heads, tp, pp, gpus, batch, published in MEGATRON_CORE_2024:
        micro_batch = core_micro_batch(tp, pp, gpus, batch)
        config = megatron_core_config(hidden, layers, heads, tp, pp, gpus, batch, micro_batch)
        predicted = plan(config, gpus, h100, MEGATRON_CORE).model_tflops_per_gpu
        yield "Megatron-Core 2024 " + name, predicted, published, "predicted"
    for row in HELD_OUT:
        result = plan(row.config(), row.gpus, row.hardware(), row.options)
        fits = "" if result.fits else f", does not fit ({result.peak_memory / 1e9:.0f} GB)"
        yield row.name, row.predicted(result), row.published, f"held out{fits}"


def _print_row(label: str, predicted: float, published: float, tag: str) -> None:
    error = predicted / published - 1
    print(f"{label:34s} {predicted:9.1f} {published:9.1f} {error:+7.1%}  {tag}")


if __name__ == "__main__":
    main()
