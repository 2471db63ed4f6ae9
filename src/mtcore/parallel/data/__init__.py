"""Data parallelism: bucketed fp32 gradient buffers, reductions overlapped with backward.

The settings (``config``) load with the package; the buffers and the ``DataParallel``
wrapper (torch) on first use.
"""

from mtcore import lazy_exports
from mtcore.parallel.data.config import DEFAULT_BUCKET_SIZE, DataParallelConfig, dp_overlap

_WITH_TORCH = {
    "Bucket": ".buffer",
    "GradBuffer": ".buffer",
    "DataParallel": ".ddp",
    "LaunchRecord": ".ddp",
}


__getattr__ = lazy_exports(__name__, _WITH_TORCH)


__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "Bucket",
    "DataParallel",
    "DataParallelConfig",
    "GradBuffer",
    "LaunchRecord",
    "dp_overlap",
]
