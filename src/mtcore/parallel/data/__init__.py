"""Data parallelism: bucketed fp32 gradient buffers, reductions overlapped with backward."""

from mtcore.parallel.data.buffer import Bucket, GradBuffer
from mtcore.parallel.data.ddp import (
    DEFAULT_BUCKET_SIZE,
    DataParallel,
    DataParallelConfig,
    LaunchRecord,
)

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "Bucket",
    "DataParallel",
    "DataParallelConfig",
    "GradBuffer",
    "LaunchRecord",
]
