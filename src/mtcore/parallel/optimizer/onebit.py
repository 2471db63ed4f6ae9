"""1-bit Adam (Tang et al. 2021, "1-bit Adam: communication efficient large-scale
training with Adam's convergence speed"; DeepSpeed's ``OneBitAdam`` is the peer).

Adam's variance stabilises early in training; once it is frozen, Adam is a
momentum SGD with a fixed per-element learning rate, and momentum tolerates
1-bit compression when the compression error is fed back. So:

* **warm-up** (the first ``freeze_step`` steps): plain AdamW, gradients all-reduced
  in full precision by ``DataParallel`` as usual;
* **compression** (every later step): the variance is frozen; ``DataParallel``
  does not reduce the gradients. Each rank updates the momentum with its own
  (local) gradient and the ranks average that momentum through
  ``OneBitReducer``: signs plus one scale per block of 128 elements (finer than
  DeepSpeed's one scale per tensor: a flat buffer mixes layers whose momenta differ
  by orders of magnitude; docs/results/onebit.md has the default job's losses for
  blocks of 128, 256 and 2048), with error feedback on the
  worker side (what a rank's compression lost is added to its next momentum)
  and on the server side (what the re-compression of a rank's averaged chunk
  lost). Every rank ends with the same averaged momentum, so the momentum and
  the variance stay replicated: checkpoints save them as AdamW's, and only the
  error-feedback buffers are per rank (``rank_state``).

Why not ZeRO-1: each rank compresses its *whole* local momentum ``b1 m + (1-b1)
g_rank``, so it needs the whole momentum, which ZeRO-1 shards. DeepSpeed's
OneBitAdam is not offered with ZeRO either. Expert (MoE) params are reduced over
their own group with their own gradient scaling and are refused for now.

Bytes per step on the dp reduction, for N gradient elements over n ranks and blocks
of B elements: one all-to-all of N/8 bytes of signs plus 4N/B of scales, and one
all-gather of 1/n of that, against 4N for an fp32 all-reduce: (1/32 + 1/B)(1 + 1/n)
of it, 1/20.5 at n=4 and B=128.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mtcore.parallel.clip import global_norm
from mtcore.parallel.layout import Axis
from mtcore.parallel.optimizer.adamw import AdamW

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_BLOCK = 128  # elements per scale: 4 bytes of scale per 16 bytes of signs


def pack_signs(nonnegative: Tensor) -> Tensor:
    """A bool tensor of 8k elements (True: >= 0) as k bytes, element 8i+b in bit b of byte i."""
    if nonnegative.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {nonnegative.numel()}")
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=nonnegative.device)
    bits = nonnegative.reshape(-1, 8).to(torch.uint8) * weights
    return bits.sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """The inverse of ``pack_signs``: k bytes back to 8k bools."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.reshape(-1, 1) & weights).ne(0).reshape(-1)


def decode(signs: Tensor, scales: Tensor, block: int) -> Tensor:
    """+scale where the sign bit is set, -scale elsewhere; ``scales`` has one entry per
    ``block`` consecutive signs.

    As ``sign * 2 scale - scale``: exactly +-scale (doubling and the subtraction are
    exact), and several times faster on CPU than ``torch.where`` with broadcast scales."""
    scales = scales.reshape(-1, 1)
    out = signs.reshape(-1, block).to(scales.dtype).mul_(2 * scales).sub_(scales)
    return out.reshape(-1)


def block_scales(x: Tensor, real: Tensor, block: int) -> Tensor:
    """The scale of each ``block`` of ``x``: the mean |x| of its ``real`` elements (the
    rest of the block is padding, which holds zeros). For sign compression mean |x| is
    the scale with the least squared error; a block of padding only has scale 0."""
    return x.reshape(-1, block).abs().sum(dim=1) / real


class OneBitReducer:
    """The compressed average of one flat fp32 tensor over a data-parallel group.

    The tensor (``numel`` elements) is padded to ``size`` equal chunks, each a whole
    number of blocks of ``block`` elements (fewer for a small tensor: one block per
    chunk, a multiple of 8); chunk ``j`` is served by rank ``j`` of the group, and
    every block travels as its signs plus one float32 scale. ``worker_error`` (the
    padded length) and ``server_error`` (one chunk) are this rank's error feedback;
    padding positions of both stay zero.
    """

    def __init__(
        self, numel: int, collective, group, size: int, rank: int, device, block=DEFAULT_BLOCK
    ):
        if block % 8:
            raise ValueError(f"the compression block must be a multiple of 8, got {block}")
        self.numel, self.collective, self.group = numel, collective, group
        self.size, self.rank = size, rank
        per_rank = -(-numel // size)
        self.block = min(block, -(-per_rank // 8) * 8)
        self.chunk = -(-per_rank // self.block) * self.block
        starts = torch.arange(0, self.chunk * size, self.block, dtype=torch.float32)
        real = (numel - starts).clamp(0, self.block)
        self.real = [int(min(self.chunk, max(0, numel - j * self.chunk))) for j in range(size)]
        # elements per block, padding excluded (1 for blocks of padding only: their sum is 0)
        self._block_real = real.clamp(min=1).to(device).view(size, -1)
        self.worker_error = torch.zeros(self.chunk * size, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)

    @property
    def message_bytes(self) -> int:
        """Bytes of one chunk on the wire: its signs, then its blocks' scales."""
        return self.chunk // 8 + 4 * (self.chunk // self.block)

    @torch.no_grad()
    def average_(self, x: Tensor) -> Tensor:
        """Replace ``x`` (this rank's value) by the compressed average over the group."""
        n, c, b = self.size, self.chunk, self.block
        buf = torch.zeros(n * c, dtype=torch.float32, device=x.device)
        buf[: self.numel] = x
        buf += self.worker_error
        scales = block_scales(buf, self._block_real.reshape(-1), b)
        signs = buf >= 0
        self.worker_error = buf - decode(signs, scales, b)
        self.worker_error[self.numel :] = 0
        send = torch.cat([pack_signs(signs).view(n, c // 8), _as_bytes(scales).view(n, -1)], dim=1)
        recv = torch.empty_like(send)
        self.collective.all_to_all(recv, send, group=self.group)

        # Server: average the n workers' versions of my chunk, in rank order.
        real = self.real[self.rank]
        acc = torch.zeros(c, dtype=torch.float32, device=x.device)
        for i in range(n):
            acc += decode(*self._split(recv[i]), b)
        acc /= n
        acc[real:] = 0
        served = acc + self.server_error
        served_scales = block_scales(served, self._block_real[self.rank], b)
        served_signs = served >= 0
        self.server_error = served - decode(served_signs, served_scales, b)
        self.server_error[real:] = 0
        mine = torch.cat([pack_signs(served_signs), _as_bytes(served_scales)])
        gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=x.device)
        self.collective.all_gather(gathered, mine, group=self.group)

        out = torch.cat([decode(*self._split(m), b) for m in gathered.view(n, -1)])
        x.copy_(out[: self.numel])
        return x

    def _split(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """(signs, scales) of one chunk's message: packed signs, then float32 scales."""
        signs = self.chunk // 8
        scales = message[signs:].clone().view(torch.float32)
        return unpack_signs(message[:signs]), scales


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


class OneBitAdam(AdamW):
    """1-bit Adam over ``DataParallel``'s flat buffers (replicated state, not ZeRO-1).

    freeze_step: the steps of plain AdamW (full-precision gradient reduction) before
    the variance freezes and the momentum reduction is compressed. block_size: the
    elements that share one scale (a multiple of 8). The other
    arguments are ``AdamW``'s. The compression stage keeps AdamW's form: decoupled
    weight decay, the momentum's bias correction at the current step and the
    variance's at ``freeze_step`` (the step it froze at). On a single data-parallel
    rank nothing is sent, so nothing is compressed.

    The gradient norm of a compression step (clipping, and the non-finite check) is
    the root mean square of the ranks' local gradient norms, an upper bound on the
    norm of the averaged gradient, equal on every rank.
    """

    def __init__(self, ddp, *, freeze_step: int = 100, block_size: int = DEFAULT_BLOCK, **kwargs):
        if ddp.config.shard_optimizer:
            raise ValueError(
                "onebit_adam cannot run with ZeRO-1 (parallel.zero1): every rank compresses "
                "its whole local momentum, so the momentum cannot be sharded over dp"
            )
        if Axis.EDP in ddp.reductions:
            raise ValueError(
                "onebit_adam compresses the dense data-parallel reduction only; a model with "
                "expert-parallel (MoE expert) params is not supported"
            )
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (steps of plain Adam), got {freeze_step}")
        super().__init__(ddp, **kwargs)
        self.freeze_step = freeze_step
        group, size, rank = ddp.reductions[Axis.DP_CP]
        self._dp_size = size
        buffers = [b for b in ddp.grad_buffers if any(s.buffer is b for s in self.segments)]
        self._flat = list(zip(buffers, self._state["exp_avg"], strict=True))
        for buf, m in self._flat:
            if m.numel() != buf.numel:
                raise AssertionError("replicated optimizer state must cover its buffer exactly")
        self.reducers = [
            OneBitReducer(buf.numel, self.collective, group, size, rank, buf.device, block_size)
            for buf, _ in self._flat
        ]
        self._compress_this_step = self.compressing
        # sqrt(v / bias2) + eps per segment: constant once v froze (4 bytes per param)
        self._denoms: list[Tensor] | None = None

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compression stage."""
        return self.step_count >= self.freeze_step

    def zero_grad(self) -> None:
        """Start a step: decide its stage, and tell ``DataParallel`` whether to reduce."""
        super().zero_grad()
        self._compress_this_step = self.compressing
        self.ddp.reduce_gradients = not self._compress_this_step

    def grad_norm(self) -> Tensor:
        if not self._compress_this_step or self._dp_size == 1:
            return super().grad_norm()
        # Buffers hold g_rank / dp: the sum of squares over dp is sum ||g_rank||^2 / dp^2.
        total = global_norm(
            [s.grad for s in self._norm_segments],
            self.collective,
            [self.layout.dp_cp.group, self.layout.mp.group],
            device=self.ddp.device,
        )
        return total * math.sqrt(self._dp_size)

    def _update(self) -> None:
        if not self._compress_this_step:
            super()._update()
            return
        beta1, beta2 = self.betas
        bias1 = 1 - beta1**self.step_count
        bias2_sqrt = math.sqrt(1 - beta2**self.freeze_step)
        for (buf, m), reducer in zip(self._flat, self.reducers, strict=True):
            # The local gradient: the buffer holds g_rank / dp.
            m.mul_(beta1).add_(buf.grad, alpha=(1 - beta1) * self._dp_size)
            if self._dp_size > 1:
                reducer.average_(m)
        if self._denoms is None:
            self._denoms = [
                s.exp_avg_sq.sqrt().div_(bias2_sqrt).add_(self.eps) for s in self.segments
            ]
        for s, denom in zip(self.segments, self._denoms, strict=True):
            group = self.param_groups[s.group]
            lr, wd = group["lr"], group["weight_decay"]
            s.master.mul_(1 - lr * wd)
            s.master.addcdiv_(s.exp_avg, denom, value=-lr / bias1)

    # -- checkpoints ----------------------------------------------------------------
    def rank_state(self) -> dict[str, Tensor]:
        """This rank's error-feedback buffers (they differ between dp ranks), by name."""
        out = {}
        for i, r in enumerate(self.reducers):
            out[f"worker_error.{i}"] = r.worker_error
            out[f"server_error.{i}"] = r.server_error
        return out

    @torch.no_grad()
    def load_rank_state(self, state: dict[str, Tensor]) -> None:
        """Restore ``rank_state()`` saved by the same rank under the same layout."""
        for i, r in enumerate(self.reducers):
            for kind in ("worker_error", "server_error"):
                saved, mine = state[f"{kind}.{i}"], getattr(r, kind)
                if saved.shape != mine.shape:
                    raise ValueError(
                        f"1-bit Adam {kind} {i} has {saved.numel()} elements, this rank needs "
                        f"{mine.numel()} (a different layout or bucket size?)"
                    )
                mine.copy_(saved)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["onebit"] = {
            "freeze_step": self.freeze_step,
            **{k: v.clone() for k, v in self.rank_state().items()},
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        saved = state.get("onebit")
        if saved is not None:
            self.load_rank_state(saved)
        self._compress_this_step = self.compressing
        self._denoms = None  # from the loaded variance
