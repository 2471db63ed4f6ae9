"""What the side-by-side trainer benchmarks (bench_trainer.py, bench_bert.py) build alike.

Each trains one model from the same weights in a plain PyTorch loop and in mtcore's
``Engine`` (one process), on the CPU backend as shipped and on one that also
registers torch-native kernels. The models and batches differ; the plain loop's
optimizer, the engine and the native backend do not, so both take them from here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.backend import KernelImpl, select_backend
from mtcore.backend.spec import Backend
from mtcore.ops.torch_native import fused_adamw_step, fused_rms_norm, sdpa_attention
from mtcore.parallel.layout import ParallelLayout
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine


def plain_adamw(model: nn.Module, opt: OptimizerConfig) -> torch.optim.AdamW:
    """torch's AdamW over ``model``'s parameters (a tied weight once) as mtcore's AdamW
    decays them: matrices with ``opt.weight_decay``, vectors (norms, biases) without."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr: float,
    max_grad_norm: float,
    losses: Iterable[Tensor],
) -> float:
    """One optimizer step of the plain loop: ``lr`` set, gradients zeroed, a backward per
    micro-batch loss of ``losses`` (a generator: each forward runs just before its
    backward, as in a training loop), global-norm clipping, the step. Returns the sum
    of the losses."""
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for loss in losses:
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return total


def one_process_engine(
    config, backend, micro_batch_size: int, num_microbatches: int, opt: OptimizerConfig
) -> Engine:
    """The trainer's ``Engine`` for ``config`` in one process (seed 0)."""
    return Engine(
        config,
        ParallelLayout.single(),
        backend,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        optimizer=opt,
        seed=0,
    )


def silu_swiglu(x):
    """``mtcore.ops.swiglu`` as ``F.silu(gate) * up`` (in the input dtype)."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def native_backend(extra: tuple[KernelImpl, ...] = ()):
    """The CPU backend plus torch-native kernels (and ``extra``), registered as a plugin would."""
    cpu = select_backend("cpu")
    kernels = [
        KernelImpl("attention", sdpa_attention, "sdpa", priority=50),
        KernelImpl("rms_norm", fused_rms_norm, "torch-rms-norm", priority=50),
        KernelImpl("swiglu", silu_swiglu, "torch-silu", priority=50),
        KernelImpl("adamw_step", fused_adamw_step, "torch-fused", priority=50),
        *extra,
    ]
    return Backend(cpu.spec, "bench-native", kernels)


def check_same_loss(losses: dict[str, float], baseline: str, rtol: float) -> None:
    """Print each configuration's loss from the same weights and batch, and assert they
    are ``baseline``'s to ``rtol``: a time is only comparable for the same math."""
    ref = losses[baseline]
    print("loss from the same weights: " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    assert all(abs(v - ref) / ref < rtol for v in losses.values()), losses
