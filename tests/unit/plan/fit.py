"""Refit the planner's two efficiency constants on the two rows named in published.FITTED.

    .venv/bin/python tests/unit/plan/fit.py

A grid search over (GEMM_EFFICIENCY, LINK_EFFICIENCY) minimising the squared relative
error of those two rows only; it prints the pair and every row's error (the other rows
are predictions). Copy the pair into src/mtcore/plan/constants.py.
"""

from __future__ import annotations

from published import FITTED, NARAYANAN_2021, narayanan_config
from test_published_rows import MEGATRON_2021

from mtcore.plan import constants, load_hardware, plan


def main() -> None:
    hardware = load_hardware("A100-80GB")
    rows = {r[0]: r for r in NARAYANAN_2021}
    configs = {name: narayanan_config(*r[1:8]) for name, r in rows.items()}

    def error(name: str) -> float:
        r = rows[name]
        return plan(configs[name], r[6], hardware, MEGATRON_2021).tflops_per_gpu / r[8] - 1

    best = None
    for gemm in (x / 100 for x in range(50, 100)):
        for link in (x / 100 for x in range(30, 101, 2)):
            constants.GEMM_EFFICIENCY, constants.LINK_EFFICIENCY = gemm, link
            loss = sum(error(name) ** 2 for name in FITTED)
            if best is None or loss < best[0]:
                best = (loss, gemm, link)
    _, constants.GEMM_EFFICIENCY, constants.LINK_EFFICIENCY = best
    print(f"GEMM_EFFICIENCY = {best[1]:.2f}\nLINK_EFFICIENCY = {best[2]:.2f}")
    for name in rows:
        tag = "fitted" if name in FITTED else "predicted"
        print(f"{name:8s} {error(name):+7.1%}  {tag}")


if __name__ == "__main__":
    main()
