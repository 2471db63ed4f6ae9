"""mtcore-cuda: the 'cpu' backend (gloo, torch's fused CPU kernels) and the 'cuda' backend (NCCL)."""

__version__ = "0.1.0"
