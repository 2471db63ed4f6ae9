"""What the traces of ``logging.profile`` (and ``mtcore plan --trace``) agree on, without
torch: ``mtcore trace merge`` and ``mtcore plan`` read and write traces without it."""

PHASES_TID, ASYNC_TID = 1_000_000_001, 1_000_000_002  # tids no thread of the OS has
TRACE_KEY = "mtcore"  # the top-level key holding what merge reads (rank, sync, ...)
