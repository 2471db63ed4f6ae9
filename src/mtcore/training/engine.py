"""One rank's share of training under any layout: build, step, evaluate, gather.

The engine knows a model only through its family (``mtcore.models.family``): the
family builds this rank's chunks, names the tensors that cross each pipeline
boundary, and gives its loss as (sum, count) terms. The same path serves every
family and layout. The rank's model chunks sit in
one ``DataParallel`` (fp32 gradient buckets, all-reduce or ZeRO-1/2
reduce-scatter over dp x cp; ZeRO-2 keeps only the owned gradient shard, ZeRO-3 the
owned shard of each transformer block's params too, gathered a block at a time) with one
mtcore ``AdamW``/``DistributedAdamW``/``OneBitAdam``, both picked by one entry of the
strategy table (``mtcore.parallel.data.strategies``), and a ``PipelineRunner`` runs the
micro-batches: ``no_pipelining`` (gradient accumulation) at pp=1, 1F1B /
interleaved / GPipe otherwise. A step:

1. the runner runs every micro-batch forward and backward; each model chunk's
   last backward launches that chunk's bucket reductions as buckets fill, while
   the rest of the pipeline's backward goes on (overlap, per chunk as in Megatron);
2. the halves of a tied embedding/output weight split over pipeline stages have
   buckets of their own that backward leaves alone: they are summed over the
   first and last stage, *then* ``finish_grad_sync`` reduces them over dp (a
   ZeRO-1 shard cannot be summed across stages after it);
3. the loss is agreed on every rank (sum over pp and dp); a NaN/inf loss skips
   the step everywhere. Each term's global count (over micro-batches and dp) is
   summed before the step from the batches (``ModelFamily.loss_counts``), so a
   micro-batch's backward is weighted by its share of that count: the loss and the
   gradients are the token-weighted mean of one process, whatever the split
   (padding and MLM masks make the counts differ between ranks);
4. the global gradient norm (over tp and pp ranks, and dp under ZeRO-1) is both
   the clipping norm and the inf/nan check: a non-finite norm skips the step on
   every rank, at no extra pass over the gradients. Under fp16 the optimizer's
   loss scaler does this instead (unscale, check, back off, clip).

FP8 delayed scaling is bookkept once per step (``FP8StepBookkeeping``): after the
pipeline, the step's amaxes of every FP8 linear are reduced in one collective per
group and the step's cached FP8 weights dropped. ``optimizer.name: onebit_adam``
puts ``OneBitAdam`` in AdamW's place (it switches the dp reduction off itself in
its compression stage). ``lora`` (``finetune.lora``) freezes the model and adds
low-rank adapters before anything else sees it: DataParallel, the optimizer and the
checkpoints then hold the adapters alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mtcore.backend.collective import P2P
from mtcore.backend.tracing import phase
from mtcore.models import Batch, FamilyConfig, LoRAConfig, add_lora, family_of
from mtcore.parallel.clip import clip_by_total_norm_
from mtcore.parallel.data import DataParallel, dp_overlap, strategy_for
from mtcore.parallel.layout import Axis
from mtcore.parallel.pipeline import (
    PipelineGroups,
    PipelineRunner,
    allreduce_tied_grads,
    build_schedule,
)
from mtcore.parallel.tensor import full_tensors
from mtcore.precision import MixedPrecision
from mtcore.precision.fp8 import FP8StepBookkeeping
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
    terms: dict[str, float] | None = None  # each loss term's global mean (sum of them: loss)
    stop: bool = False  # some rank asked to stop after this step (``train_step(stop=True)``)
    counts: dict[str, float] | None = None  # each term's global count (trained tokens for "lm")


class Engine:
    """Model chunks, data parallel, optimizer and pipeline runner of one rank."""

    def __init__(
        self,
        config: FamilyConfig,
        layout,
        backend,
        *,
        micro_batch_size: int,
        num_microbatches: int,
        optimizer: OptimizerConfig | None = None,
        precision: MixedPrecision | None = None,
        seed: int = 0,
        schedule: str = "1f1b",
        zero: int = 0,
        bucket_size: int | None = None,
        lora: LoRAConfig | None = None,
    ):
        optimizer = optimizer or OptimizerConfig()
        precision = precision or MixedPrecision("fp32")
        self.config, self.layout, self.backend = config, layout, backend
        self.collective = backend.collective
        self.family = family_of(config)
        built = self.family.build(config, layout, backend, seed, fp8=precision.fp8)
        self.chunks, self.rng_tracker = built.chunks, built.rng_tracker
        self.seed = seed
        self.lora = lora  # LoRA: the base frozen (no gradient buffer, no optimizer state)
        if lora is not None:
            add_lora(self.chunks, lora)
        for chunk in self.chunks:
            precision.cast_module(chunk)
        self.fp8 = FP8StepBookkeeping(self.chunks)  # amaxes reduced, weights cast once a step
        self.dtype = precision.param_dtype
        module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        # the ZeRO stage and the optimizer: one entry of the strategy table
        strategy = strategy_for(zero, optimizer.name)
        sizes = {} if bucket_size is None else {"bucket_size": bucket_size}
        dp_config = strategy.data_parallel_config(
            **sizes, overlap_grad_reduce=dp_overlap(backend)[0]
        )
        # Tied halves on other stages are summed over the stages before their dp reduction.
        self.tied = [p for chunk in self.chunks for p in chunk.tied_copies() if p.requires_grad]
        # ZeRO-3 gathers the params of one transformer block at a time; the rest stay whole.
        blocks = [block for chunk in self.chunks for block in chunk.layers.values()]
        self.ddp = DataParallel(module, layout, backend, dp_config, chunks=self.chunks,
                                deferred=self.tied, units=blocks)  # fmt: skip
        scaler = precision.make_loss_scaler()
        self.max_grad_norm = optimizer.max_grad_norm
        self.optimizer = strategy.build_optimizer(
            self.ddp,
            optimizer,
            lr=optimizer.lr,
            betas=tuple(optimizer.betas),
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            loss_scaler=scaler,
            max_grad_norm=self.max_grad_norm if scaler is not None else None,  # else step 4
        )
        self.groups = PipelineGroups.build(layout, self.collective)
        experts = config.experts.num_experts if config.experts is not None else 0
        self.moe = MoEStep(self.chunks, layout, self.collective, self.ddp.device, experts)
        self.pp, self.m = layout.pp, num_microbatches
        self.dp_cp_size = layout.dp_cp.size  # data replicas: the loss is their mean
        name = "no_pipelining" if self.pp == 1 else schedule
        sched = build_schedule(name, self.pp, num_microbatches, layout.spec.vpp)
        self.messages = self.family.messages(config, layout, micro_batch_size, self.dtype)
        self.runner = PipelineRunner(
            self.chunks,
            sched,
            self.groups,
            backend,
            self.messages,
            loss_fn=self._loss,
            dtype=self.dtype,
            timing=False,
            grad_sync=self.ddp,
        )
        self._counts: dict[str, Tensor] = {}
        self._terms: dict[str, list[Tensor]] = {}

    # -- the loss ------------------------------------------------------------------
    def global_counts(self, batches: list[Batch]) -> dict[str, Tensor]:
        """Each loss term's count over every micro-batch of every dp rank (one
        all-reduce over dp_cp of a few numbers; every rank holds its batches)."""
        per_term: dict[str, Tensor] = {}
        for batch in batches:
            for name, count in self.family.loss_counts(self.config, batch).items():
                per_term[name] = per_term.get(name, 0) + count.to(torch.float64)
        names = sorted(per_term)
        counts = torch.stack([per_term[n] for n in names]).to(self.ddp.device)
        if self.dp_cp_size > 1:
            self.collective.all_reduce(counts, group=self.layout.dp_cp.group)
        return dict(zip(names, counts, strict=True))

    def _loss(self, outputs: dict[str, Tensor], batch: Batch) -> Tensor:
        """A micro-batch's loss as backpropagated: per term, its mean over the
        micro-batch divided by the micro-batch's weight ``N / (dp * n)`` (``n`` its
        count, ``N`` the global count), i.e. ``dp * sum / N``; DataParallel's mean over
        dp then gives ``sum / N``. With equal counts the weight is exactly the number
        of micro-batches, so the arithmetic is the plain mean's."""
        total = None
        for name, (loss_sum, count) in self.chunks[-1].loss(outputs, batch).items():
            count = count.clamp(min=1)
            weight = self._counts[name].clamp(min=1) / (self.dp_cp_size * count)
            term = (loss_sum / count) / weight.to(loss_sum.dtype)
            self._terms.setdefault(name, []).append(term.detach())
            total = term if total is None else total + term
        return self.optimizer.scale_loss(total)

    # -- training ------------------------------------------------------------------
    def train_step(self, batches: list[Batch], stop: bool = False) -> StepOutcome:
        """One optimizer step on the ``num_microbatches`` micro-batches of this dp rank
        (each a family batch: named tensors). ``stop``: this rank asks the job to stop
        after this step; the outcome's ``stop`` is whether any rank did (carried by the
        loss reduction, so every rank learns it at this step at no extra collective)."""
        if len(batches) != self.m:
            raise ValueError(f"train_step needs {self.m} micro-batches, got {len(batches)}")
        scaler = self.optimizer.loss_scaler
        # Aux losses get the main loss's factor: 1/micro-batches, times the loss scale.
        self.moe.set_aux_loss_scale((scaler.scale if scaler is not None else 1.0) / self.m)
        out = self._step(batches, stop)
        if self.config.experts is None:
            return out
        return dataclasses.replace(out, moe=self.moe.finish(stepped=not out.skipped))

    def _step(self, batches: list[Batch], stop: bool) -> StepOutcome:
        # The phases are the named ranges of a trace (mtcore.backend.tracing); the
        # pipeline runner names its own actions.
        with phase("zero grad", "optimizer"):
            self.optimizer.zero_grad()
        scaler = self.optimizer.loss_scaler
        scale = scaler.scale if scaler is not None else 1.0
        with phase("loss counts", "comm"):
            self._counts, self._terms = self.global_counts(batches), {}
        # each chunk's last backward launches its buckets; the stats: the straggler report's
        self.last_pipeline = self.runner.step(batches)
        with phase("fp8 amax", "comm"):
            self.fp8.finish_step()
        if self.tied:
            with phase("tied grads", "comm"):
                allreduce_tied_grads(self.tied, self.groups, self.collective)
        with phase("dp grad sync", "comm"):
            self.ddp.finish_grad_sync()
        with phase("loss agree", "comm"):
            terms, stop = self._agree_terms(stop)
        loss = sum(terms.values()) if terms else math.nan
        counts = {name: float(count) for name, count in self._counts.items()}
        outcome = functools.partial(StepOutcome, terms=terms, stop=stop, counts=counts)
        if not math.isfinite(loss):
            return outcome(loss, "loss", None, scale if scaler else None)
        with phase("optimizer", "optimizer"):
            if scaler is not None:
                result = self.optimizer.step()
                return outcome(loss, "" if result.stepped else "grad", result.grad_norm, scale)
            norm = self.optimizer.grad_norm()  # agreed by every rank that holds other gradients
            if not math.isfinite(norm_value := norm.item()):
                return outcome(loss, "grad", norm_value, None)
            if self.max_grad_norm is not None:
                grads = [segment.grad for segment in self.optimizer.segments]
                clip_by_total_norm_(grads, self.max_grad_norm, norm)
            self.optimizer.step()
        return outcome(loss, "", norm_value, None)

    def _agree_terms(self, stop: bool) -> tuple[dict[str, float], bool]:
        """Each term's global mean on every rank (the last stage's weighted micro-batch
        losses, summed over micro-batches, pp and dp, divided by dp; kept before fp16's
        loss scale multiplies them), and whether any rank asked to stop."""
        names = sorted(self._counts)
        local = [
            torch.stack(self._terms[n]).sum().item() if n in self._terms else 0.0 for n in names
        ]
        *sums, stops = self.agree_sums(local, flag=stop)
        return dict(zip(names, sums, strict=True)), stops > 0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def agree_sums(
        self, local: list[float], mean_over_dp: bool = True, flag: bool | None = None
    ) -> list[float]:
        """Numbers the last stage holds (zeros elsewhere), summed over pp and dp on every
        rank; divided by dp when ``mean_over_dp``. With ``flag``, one more number at the
        end: how many ranks of the whole world passed ``flag=True``.

        The tp ranks of a stage hold equal numbers: tp rank 0's are summed, and the sum
        over tp x pp (the ``mp`` group; ``pp`` itself when tp is 1, ``tp`` when pp is 1)
        reaches every rank with the flag (the world is mp x dp_cp): an extra collective
        only when pp is 1 and tp is not, a tiny one on the tp group's own channel."""
        flags = [] if flag is None else [float(flag)]
        over_mp = self.pp > 1 or (flags and self.layout.size(Axis.TP) > 1)
        values = local if not over_mp or self.layout.tp_rank == 0 else [0.0] * len(local)
        t = torch.tensor(values + flags, dtype=torch.float32, device=self.ddp.device)
        if over_mp:  # with pp 1, mp is the tp group: its own (a same-host channel's) object
            group = self.layout.mp.group if self.pp > 1 else self.layout.group(Axis.TP)
            self.collective.all_reduce(t, group=group)
        if self.dp_cp_size > 1:
            self.collective.all_reduce(t, group=self.layout.dp_cp.group)
        sums = [
            value / self.dp_cp_size if mean_over_dp else value for value in t[: len(local)].tolist()
        ]
        return sums + t[len(local) :].tolist()

    # -- evaluation ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        """Forward only (dropout off), on every rank: ``loss`` (the sum of the terms'
        global means), each loss term's mean, and the family's metrics (accuracies),
        each as a global sum over its global count."""
        for chunk in self.chunks:
            chunk.train(False)
        try:
            sums: dict[str, list[float]] = {}  # name -> [sum, count]
            for batch in batches:
                out = self._forward_chain(batch)
                if out is None:
                    continue
                last = self.chunks[-1]
                for name, (total, count) in {
                    **last.loss(out, batch),
                    **last.metrics(out, batch),
                }.items():
                    entry = sums.setdefault(name, [0.0, 0.0])
                    entry[0] += total.item()
                    entry[1] += count.item()
            terms = sorted(self.family.loss_counts(self.config, batches[0]))
            names = terms + sorted(self.family.metric_names(self.config))
            local = [value for name in names for value in sums.get(name, [0.0, 0.0])]
            agreed = self.agree_sums(local, mean_over_dp=False)
            means = {n: agreed[2 * k] / max(agreed[2 * k + 1], 1.0) for k, n in enumerate(names)}
            return {"loss": sum(means[n] for n in terms), **means}
        finally:
            for chunk in self.chunks:
                chunk.train(True)
            self.moe.discard()  # evaluation forwards are no training load

    def eval_loss(self, batches: list[Batch]) -> float:
        """The evaluation loss alone (``evaluate(batches)["loss"]``)."""
        return self.evaluate(batches)["loss"]

    def _forward_chain(self, batch: Batch) -> dict[str, Tensor] | None:
        """One micro-batch through every virtual stage in order (blocking p2p): no
        schedule is needed without a backward. Returns the head outputs on the last stage."""
        ranks, r = self.groups.ranks, self.groups.pp_rank
        for c, chunk in enumerate(self.chunks):
            inputs = {}
            stage = c * self.pp + r
            if stage > 0:
                specs = self.messages(stage - 1)
                for name, spec in specs.items():
                    inputs[name] = torch.empty(spec.shape, dtype=spec.dtype, device=self.ddp.device)
                    self._p2p("recv", inputs[name], ranks[(r - 1) % self.pp])
            out = chunk.stage(inputs, batch)
            if chunk.last:
                return out
            for name in self.messages(stage):
                self._p2p("send", out[name].contiguous(), ranks[(r + 1) % self.pp])
        return None

    def _p2p(self, kind: str, tensor: Tensor, peer: int) -> None:
        for handle in self.collective.batch_send_recv([P2P(kind, tensor, peer, self.groups.group)]):
            handle.wait()

    # -- weights -------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The whole model's weights (unsharded, fp32, names of the family's one-process
        model) on
        global rank 0, None elsewhere. Collective: call on every rank.

        Ranks of expert-data-parallel index 0 (data-parallel index 0 without MoE)
        unshard their chunks over tp, then MoE experts over ep; the pipeline through
        rank 0 then sends each stage's tensors to rank 0 (p2p). Persistent buffers
        (a MoE router's expert bias, equal on every rank) come along.
        """
        with self.ddp.gathered_params():  # ZeRO-3: every rank gathers its blocks
            full = self._full_tensors()
        if full is None or self.layout.tp_rank != 0 or self.layout.dp_cp.rank != 0:
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

    def _full_tensors(self) -> dict[str, Tensor] | None:
        """This rank's chunks unsharded over tp and ep (None on edp ranks but the first)."""
        if self.layout.edp.size > 1 and self.layout.edp.rank != 0:
            return None
        full: dict[str, Tensor] = {}
        for chunk in self.chunks:
            tensors, keep = full_tensors(chunk, chunk.tp), chunk.own_parameter_names()
            gather_experts(chunk, tensors, self.layout, self.collective)
            full.update({name: tensors[name].to(torch.float32, copy=True) for name in keep})
            saved = set(chunk.state_dict()) - {n for n, _ in chunk.named_parameters()}
            full.update({n: b.float().clone() for n, b in chunk.named_buffers() if n in saved})
        return full

    def _send_tensors(self, tensors: dict[str, Tensor], dst: int) -> None:
        header = json.dumps([[n, list(t.shape)] for n, t in tensors.items()]).encode()
        flat = torch.cat([t.reshape(-1) for t in tensors.values()]) if tensors else torch.zeros(0)
        sizes = torch.tensor([len(header), flat.numel()], dtype=torch.int64)
        self._p2p("send", sizes.to(self.ddp.device), dst)
        self._p2p(
            "send", torch.tensor(list(header), dtype=torch.uint8, device=self.ddp.device), dst
        )
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
