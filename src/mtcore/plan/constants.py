"""The model's only two fitted numbers, and the rows they were fitted on.

Everything else in a prediction comes from a hardware file (published specs) or
from counting (FLOPs, bytes). ``GEMM_EFFICIENCY`` scales every accelerator's peak
FLOP/s (the achieved fraction of peak of large matrix products);
``LINK_EFFICIENCY`` scales every bandwidth (memory, NVLink-class links, the
network). They were fitted together, by a grid search, on two rows of Narayanan et
al. 2021 Table 1 (A100), the table's two ends: 1.7B (tp 1, 32 GPUs) and 1T (tp 8 x
pp 64, 3072 GPUs); every other row in ``tests/unit/plan/published.py`` is a
prediction. ``tests/unit/plan/fit.py`` is the search that produced them (it also
prints every published row against the model): rerun it after changing the model
(docs/plan.md). Refitted when the loss's fp32 traffic was counted op by op
(``timing.cross_entropy_bytes``): 0.81 / 0.58 became 0.81 / 0.60. Refitted when the
pipeline's fill and drain came to be counted stage by stage (``planner._plan``: the sum of
the other stages' micro-batch times, which the first stage's embedding and the last
stage's head make unequal) and a ZeRO-1 bucket's reduction as the reduce-scatter it is:
0.81 / 0.60 became 0.79 / 0.62.
"""

GEMM_EFFICIENCY = 0.79
LINK_EFFICIENCY = 0.62
FIT_ROWS = ("Narayanan 2021 Table 1: 1.7B", "Narayanan 2021 Table 1: 1T")
FIT_HARDWARE = "A100-80GB"
"""The accelerator of ``FIT_ROWS``. Another accelerator whose file gives a published
maximum achievable matmul rate (``matmul_tflops``) is credited ``GEMM_EFFICIENCY``
times its share of peak over this one's (``timing.gemm_flops``): a published
measurement, not a third fitted number."""
