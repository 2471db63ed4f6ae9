"""The model's only two fitted numbers, and the rows they were fitted on.

Everything else in a prediction comes from a hardware file (published specs) or
from counting (FLOPs, bytes). ``GEMM_EFFICIENCY`` scales every accelerator's peak
FLOP/s (the achieved fraction of peak of large matrix products);
``LINK_EFFICIENCY`` scales every bandwidth (memory, NVLink-class links, the
network). They were fitted together, by a grid search, on two rows of Narayanan et
al. 2021 Table 1 (A100), the table's two ends: 1.7B (tp 1, 32 GPUs) and 1T (tp 8 x
pp 64, 3072 GPUs); every other row in ``tests/unit/plan/published.py`` is a
prediction. ``tests/unit/plan/fit.py`` is the search that produced them: rerun it
after changing the model (docs/plan.md).
"""

GEMM_EFFICIENCY = 0.81
LINK_EFFICIENCY = 0.58
FIT_ROWS = ("Narayanan 2021 Table 1: 1.7B", "Narayanan 2021 Table 1: 1T")
