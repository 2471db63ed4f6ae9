"""Data parallelism: bucketed fp32 gradient buffers, reductions overlapped with backward.

The settings (``config``) load with the package; the buffers, the ``DataParallel``
reducer, the ZeRO stages' strategies (``zero``) and the strategy table that picks a stage
and its optimizer (``strategies``) (torch) on first use.
"""

from mtcore import lazy_exports
from mtcore.parallel.data.config import DEFAULT_BUCKET_SIZE, DataParallelConfig, dp_overlap

_WITH_TORCH = {
    "Bucket": ".buffer",
    "GradBuffer": ".buffer",
    "DataParallel": ".ddp",
    "LaunchRecord": ".ddp",
    "STRATEGIES": ".strategies",
    "DataParallelStrategy": ".strategies",
    "strategy_for": ".strategies",
}


__getattr__ = lazy_exports(__name__, _WITH_TORCH)


__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "STRATEGIES",
    "Bucket",
    "DataParallel",
    "DataParallelConfig",
    "DataParallelStrategy",
    "GradBuffer",
    "LaunchRecord",
    "dp_overlap",
    "strategy_for",
]
