"""mtcore-cuda: the 'cuda' backend (NVIDIA GPUs, NCCL). The host 'cpu' backend is the core's."""

__version__ = "0.1.0"
