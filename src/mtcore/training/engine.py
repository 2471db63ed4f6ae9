"""One rank's share of GPT training under any layout: build, step, evaluate, gather.

The same path serves every layout. The rank's model chunks (``build_gpt``) sit in
one ``DataParallel`` (fp32 gradient buckets, all-reduce or ZeRO-1
reduce-scatter over dp) with one mtcore ``AdamW``/``DistributedAdamW``, and a
``PipelineRunner`` runs the micro-batches: ``no_pipelining`` (gradient
accumulation) at pp=1, 1F1B / interleaved / GPipe otherwise. A step:

1. the runner runs every micro-batch forward and backward; at pp=1 the
   DataParallel wrapper is the runner's chunk, so the last micro-batch's
   backward launches the bucket reductions as buckets fill (overlap);
2. at pp > 1 the whole step runs under ``no_sync`` and the halves of a tied
   embedding/output weight are summed over the first and last stage *before*
   the dp reduction (a ZeRO-1 shard cannot be summed across stages after it);
3. the loss is agreed on every rank (sum over pp, mean over dp); a NaN/inf
   loss skips the step everywhere;
4. the global gradient norm (over tp and pp ranks, and dp under ZeRO-1) is both
   the clipping norm and the inf/nan check: a non-finite norm skips the step on
   every rank, at no extra pass over the gradients. Under fp16 the optimizer's
   loss scaler does this instead (unscale, check, back off, clip).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mtcore.backend.collective import P2P
from mtcore.models import GPT, ModelConfig, build_gpt
from mtcore.parallel.clip import clip_by_total_norm_
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.optimizer import AdamW, DistributedAdamW
from mtcore.parallel.pipeline import (
    PipelineGroups,
    PipelineRunner,
    allreduce_tied_grads,
    build_schedule,
)
from mtcore.parallel.tensor import full_tensors
from mtcore.precision import MixedPrecision
from mtcore.training.config import OptimizerConfig
from mtcore.training.moe import MoEStep, gather_experts


@dataclass(frozen=True)
class StepOutcome:
    """loss: the global mean (equal on every rank; NaN/inf on a bad step).
    skipped: "" when the optimizer stepped, else "loss" or "grad" (non-finite)."""

    loss: float
    skipped: str
    grad_norm: float | None
    loss_scale: float | None
    moe: dict[str, float] | None = None  # load statistics (``MoEStep.finish``); MoE models only


class Engine:
    """Model chunks, data parallel, optimizer and pipeline runner of one rank."""

    def __init__(
        self,
        config: ModelConfig,
        layout,
        backend,
        *,
        micro_batch_size: int,
        num_microbatches: int,
        optimizer: OptimizerConfig | None = None,
        precision: MixedPrecision | None = None,
        seed: int = 0,
        schedule: str = "1f1b",
        zero1: bool = False,
        bucket_size: int | None = None,
    ):
        optimizer = optimizer or OptimizerConfig()
        precision = precision or MixedPrecision("fp32")
        self.config, self.layout, self.backend = config, layout, backend
        self.collective = backend.collective
        self.chunks: list[GPT] = build_gpt(config, layout, backend, seed, fp8=precision.fp8)
        for chunk in self.chunks:
            precision.cast_module(chunk)
        self.dtype = precision.param_dtype
        module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        dp_config = DataParallelConfig(shard_optimizer=zero1)
        if bucket_size is not None:
            dp_config = DataParallelConfig(bucket_size=bucket_size, shard_optimizer=zero1)
        self.ddp = DataParallel(module, layout, backend, dp_config)
        scaler = precision.make_loss_scaler()
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = (DistributedAdamW if zero1 else AdamW)(
            self.ddp,
            lr=optimizer.lr,
            betas=tuple(optimizer.betas),
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            loss_scaler=scaler,
            max_grad_norm=self.max_grad_norm if scaler is not None else None,  # else step 4
        )
        self.groups = PipelineGroups.build(layout, self.collective)
        experts = config.moe.num_experts if config.moe is not None else 0
        self.moe = MoEStep(self.chunks, layout, self.collective, self.ddp.device, experts)
        self.tied = [p for chunk in self.chunks for p in chunk.tied_copies()]
        self.pp, self.m = layout.pp, num_microbatches
        name = "no_pipelining" if self.pp == 1 else schedule
        sched = build_schedule(name, self.pp, num_microbatches, layout.spec.vpp)
        sp = self.chunks[0].c.sequence_parallel
        seq = config.seq_len // layout.tp if sp else config.seq_len
        self.shape = (micro_batch_size, seq, config.hidden_size)
        self.runner = PipelineRunner(
            [self.ddp] if self.pp == 1 else self.chunks,
            sched,
            self.groups,
            backend,
            self.shape,
            loss_fn=self._loss,
            dtype=self.dtype,
            timing=False,
        )

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.optimizer.scale_loss(self.chunks[-1].loss(logits, targets))

    # -- training ------------------------------------------------------------------
    def train_step(self, inputs: list[Tensor], targets: list[Tensor]) -> StepOutcome:
        """One optimizer step on ``num_microbatches`` micro-batches of this dp rank."""
        scaler = self.optimizer.loss_scaler
        # Aux losses get the main loss's factor: 1/micro-batches, times the loss scale.
        self.moe.set_aux_loss_scale((scaler.scale if scaler is not None else 1.0) / self.m)
        out = self._step(inputs, targets)
        if self.config.moe is None:
            return out
        return dataclasses.replace(out, moe=self.moe.finish(stepped=not out.skipped))

    def _step(self, inputs: list[Tensor], targets: list[Tensor]) -> StepOutcome:
        self.optimizer.zero_grad()
        scaler = self.optimizer.loss_scaler
        scale = scaler.scale if scaler is not None else 1.0
        quiet = self.ddp.no_sync() if self.pp > 1 else contextlib.nullcontext()
        with quiet:
            stats = self.runner.step(inputs, targets)
        if self.tied:
            allreduce_tied_grads(self.tied, self.groups, self.collective)
        self.ddp.finish_grad_sync()
        local = stats.loss / scale if stats.loss is not None else None
        loss = self.agree_loss(local)
        if not math.isfinite(loss):
            return StepOutcome(loss, "loss", None, scale if scaler else None)
        if scaler is not None:
            result = self.optimizer.step()
            return StepOutcome(loss, "" if result.stepped else "grad", result.grad_norm, scale)
        norm = self.optimizer.grad_norm()  # agreed by every rank that holds other gradients
        if not math.isfinite(norm_value := norm.item()):
            return StepOutcome(loss, "grad", norm_value, None)
        if self.max_grad_norm is not None:
            grads = [segment.grad for segment in self.optimizer.segments]
            clip_by_total_norm_(grads, self.max_grad_norm, norm)
        self.optimizer.step()
        return StepOutcome(loss, "", norm_value, None)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def agree_loss(self, local: float | None) -> float:
        """The last stage's mean loss, summed over pp and averaged over dp, on every rank."""
        t = torch.tensor([0.0 if local is None else local], device=self.ddp.device)
        if self.pp > 1:
            self.collective.all_reduce(t, group=self.layout.group("pp"))
        dp = self.layout.size("dp_cp")
        if dp > 1:
            self.collective.all_reduce(t, group=self.layout.group("dp_cp"))
        return t.item() / dp

    # -- evaluation ----------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, inputs: list[Tensor], targets: list[Tensor]) -> float:
        """Mean loss over the micro-batches, forward only (dropout off), on every rank."""
        for chunk in self.chunks:
            chunk.train(False)
        try:
            total = 0.0
            for x, y in zip(inputs, targets, strict=True):
                out = self._forward_chain(x)
                if out is not None:
                    total += self.chunks[-1].loss(out, y).item()
            return self.agree_loss(total / len(inputs) if self.runner.has_last else None)
        finally:
            for chunk in self.chunks:
                chunk.train(True)
            self.moe.discard()  # evaluation forwards are no training load

    def _forward_chain(self, tokens: Tensor) -> Tensor | None:
        """One micro-batch through every virtual stage in order (blocking p2p): no
        schedule is needed without a backward. Returns logits on the last stage."""
        ranks, r = self.groups.ranks, self.groups.pp_rank
        out = None
        for c, chunk in enumerate(self.chunks):
            x = tokens
            if not (r == 0 and c == 0):
                x = torch.empty(self.shape, dtype=self.dtype, device=self.ddp.device)
                self._p2p("recv", x, ranks[(r - 1) % self.pp])
            out = chunk(x)
            if chunk.last:
                return out
            self._p2p("send", out.contiguous(), ranks[(r + 1) % self.pp])
        return None

    def _p2p(self, kind: str, tensor: Tensor, peer: int) -> None:
        for handle in self.collective.batch_send_recv([P2P(kind, tensor, peer, self.groups.group)]):
            handle.wait()

    # -- weights -------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The whole model's weights (unsharded, fp32, names of ``GPT(config)``) on
        global rank 0, None elsewhere. Collective: call on every rank.

        Ranks of expert-data-parallel index 0 (data-parallel index 0 without MoE)
        unshard their chunks over tp, then MoE experts over ep; the pipeline through
        rank 0 then sends each stage's tensors to rank 0 (p2p). Persistent buffers
        (a MoE router's expert bias, equal on every rank) come along.
        """
        if self.layout.size("edp") > 1 and self.layout.coordinate("edp") != 0:
            return None
        full: dict[str, Tensor] = {}
        for chunk in self.chunks:
            tensors, keep = full_tensors(chunk, chunk.tp), chunk.own_parameter_names()
            gather_experts(chunk, tensors, self.layout, self.collective)
            full.update({name: tensors[name].float() for name in keep})
            saved = set(chunk.state_dict()) - {n for n, _ in chunk.named_parameters()}
            full.update({n: b.float().clone() for n, b in chunk.named_buffers() if n in saved})
        if self.layout.tp_rank != 0 or self.layout.coordinate("dp_cp") != 0:
            return None
        if self.pp == 1:
            return full
        ranks = self.groups.ranks
        if self.groups.pp_rank > 0:
            self._send_tensors(full, ranks[0])
            return None
        for stage in range(1, self.pp):
            full.update(self._recv_tensors(ranks[stage]))
        return full

    def _send_tensors(self, tensors: dict[str, Tensor], dst: int) -> None:
        header = json.dumps([[n, list(t.shape)] for n, t in tensors.items()]).encode()
        flat = torch.cat([t.reshape(-1) for t in tensors.values()]) if tensors else torch.zeros(0)
        sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
        self._p2p("send", sizes.to(self.ddp.device), dst)
        self._p2p("send", torch.tensor(list(header), dtype=torch.uint8, device=self.ddp.device), dst)
        self._p2p("send", flat.to(self.ddp.device), dst)

    def _recv_tensors(self, src: int) -> dict[str, Tensor]:
        device = self.ddp.device
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        self._p2p("recv", sizes, src)
        header = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
        self._p2p("recv", header, src)
        flat = torch.empty(int(sizes[1]), dtype=torch.float32, device=device)
        self._p2p("recv", flat, src)
        out, offset = {}, 0
        for name, shape in json.loads(bytes(header.cpu().tolist()).decode()):
            n = math.prod(shape)
            out[name] = flat[offset : offset + n].view(shape).cpu()
            offset += n
        return out
