"""mtcore-musa: the 'musa' backend for Moore Threads GPUs, written against torch_musa.

Importing this package never imports torch_musa: plugin discovery must stay cheap
and must not fail on machines without it. torch_musa is imported the first time
the backend's availability is asked for.
"""

__version__ = "0.1.0"
