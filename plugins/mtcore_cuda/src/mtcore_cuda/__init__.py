"""mtcore-cuda: the 'cpu' backend (gloo, reference kernels) and the 'cuda' backend (NCCL)."""

__version__ = "0.1.0"
