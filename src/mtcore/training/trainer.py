"""The training loop: one call per rank, ``train(config)``.

Ranks come from the environment that ``torchrun`` (``torch.distributed.run``)
sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without it the job is one
process. Everything that can be checked is checked before the process group
starts (``prepare``): the layout against the number of processes, the batch
arithmetic, the data paths, the tokenizer's vocabulary against the model's.
Rank 0 prints and writes TensorBoard events; every rank holds the agreed loss.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

import torch
import yaml

from mtcore.backend.tracing import phase
from mtcore.data import DataError
from mtcore.data.loader import ALONE, SampleGroup
from mtcore.models import FamilyConfig, FamilyData, family_of
from mtcore.parallel.context import check_backend_serves, shard_batch
from mtcore.parallel.layout import Axis, LayoutError, LayoutSpec, ParallelLayout
from mtcore.parallel.pipeline import SplitError
from mtcore.precision import DynamicLossScaler
from mtcore.training import stragglers
from mtcore.training.backend_check import local_device_index, verify_backend
from mtcore.training.checkpoint import CheckpointError
from mtcore.training.checkpoint.lineage import fingerprint
from mtcore.training.checkpoint.manifest import has_checkpoint, resolve_checkpoint, step_dir_name
from mtcore.training.checkpoint.owner import claim as claim_checkpoint_dir
from mtcore.training.checkpoint.trainer_io import TrainerCheckpoints
from mtcore.training.config import ConfigError, TrainConfig
from mtcore.training.elastic import ElasticRun, describe_nodes
from mtcore.training.engine import Engine, StepOutcome
from mtcore.training.metrics import (
    Progress,
    Scalars,
    format_bytes,
    format_mfu,
    format_moe,
    peak_tflops,
    perplexity,
)
from mtcore.training.preemption import Preempted, StopSignal
from mtcore.training.profiling import StepProfiler
from mtcore.training.writable import check_output_dirs


class TrainingError(RuntimeError):
    """Training cannot go on (too many bad steps in a row); the message says why."""


class Prepared(NamedTuple):
    spec: LayoutSpec
    microbatches: int
    data: FamilyData
    model: FamilyConfig


def prepare(config: TrainConfig, world_size: int, rank: int = 0) -> Prepared:
    """Validate the job for ``world_size`` processes and build (or map) its data.

    Raises ConfigError for every problem with the input: a layout that does not
    fit the processes or the model, batch sizes that do not divide, a directory
    the job writes that cannot be written (``rank``: whose directories), a missing
    or empty data path, a tokenizer with more ids than the model's vocabulary.
    """
    try:
        spec, microbatches = config.check(world_size)
        check_run_directory(config)
        check_wandb(config)
        check_output_dirs(config, rank)  # before the data layer writes its cache
        data = family_of(config.model).data(config.data, config.model)
        model = config.model.with_vocab(data.tokenizer.vocab_size)
        model.check_layout(spec)
    except (LayoutError, SplitError, DataError, ValueError) as e:
        raise ConfigError(str(e)) from e
    return Prepared(spec, microbatches, data, model)


def wandb_settings(config: TrainConfig) -> dict:
    """``wandb.init`` keywords of the run: its name, project, mode, and a directory beside
    its TensorBoard events (``runs/<run_name>/wandb``)."""
    log = config.logging
    base = log.tensorboard_dir or config.checkpoint.dir or f"runs/{log.run_name}/tensorboard"
    directory = Path(base).expanduser().parent / "wandb"
    return dict(
        project=log.wandb_project, name=log.run_name, mode=log.wandb_mode, dir=str(directory)
    )


def check_wandb(config: TrainConfig) -> None:
    if config.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb needs the wandb package: pip install 'mtcore[wandb]' "
            "(or set logging.wandb false)"
        )


def check_run_directory(config: TrainConfig) -> None:
    """ConfigError when ``checkpoint.dir`` holds another run's checkpoints and this run
    does not resume them: its saves would replace theirs, step for step.

    Another run is one whose saved ``config.yaml`` names another ``logging.run_name``
    (checkpoints from before run names were saved count as no one's)."""
    ck = config.checkpoint
    if ck.dir is None or ck.resume:
        return
    root = Path(ck.dir).expanduser()
    try:
        if not has_checkpoint(root):
            return
        latest = resolve_checkpoint(root)
        saved = yaml.safe_load((latest / "config.yaml").read_text())
    except (CheckpointError, OSError, yaml.YAMLError):
        return  # unreadable: the save or the resume path reports it
    other = (
        ((saved or {}).get("logging") or {}).get("run_name") if isinstance(saved, dict) else None
    )
    if isinstance(other, str) and other != config.logging.run_name:
        raise ConfigError(
            f"checkpoint.dir {root} holds the checkpoints of run {other!r} (latest "
            f"{latest.name}); this run is {config.logging.run_name!r}. Resume that run "
            "(--checkpoint.resume true), or give this one its own directory "
            "(--checkpoint.dir, or no checkpoint.dir in the config: runs/<run_name>/)"
        )


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per step (NaN for skipped ones)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    checkpoint: Path | None = None
    sample: str | None = None
    wall_s: float = 0.0
    start_step: int = 0  # a resumed run's first step is start_step + 1
    moe: list[dict[str, float]] = field(default_factory=list)  # per step: load statistics
    val_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # evaluate()


class BadStepGuard:
    """Counts consecutive bad steps; a skipped fp16 step whose loss scale can still
    back off is the scaler doing its job, not a bad step."""

    def __init__(self, max_bad: int, scaler):
        self.max_bad, self.scaler, self.run = max_bad, scaler, 0

    def observe(self, step: int, out: StepOutcome) -> str | None:
        """A message for a skipped step (None when it stepped); raises after too many."""
        if not out.skipped:
            self.run = 0
            return None
        what = "loss" if out.skipped == "loss" else "gradients"
        backs_off = isinstance(self.scaler, DynamicLossScaler) and out.skipped == "grad"
        if backs_off and out.loss_scale is not None and out.loss_scale > self.scaler.min_scale:
            return f"step {step}: fp16 gradient overflow, loss scale {out.loss_scale:g} -> {self.scaler.scale:g}, step skipped"
        self.run += 1
        msg = (
            f"step {step}: non-finite {what} (loss {out.loss}), step skipped ({self.run} in a row)"
        )
        if self.run >= self.max_bad:
            raise TrainingError(
                f"{msg}; stopping after {self.run} consecutive bad steps "
                "(training.max_bad_steps). Lower optimizer.lr, check the data, or use bf16/fp32."
            )
        return msg


def train(config: TrainConfig, stream: TextIO | None = None) -> TrainResult:
    """Run the whole job on this rank; returns what rank 0 observed (all ranks agree on losses)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    config = config.model_copy(deep=True)  # the run fills in values (decay_steps): not the caller's
    run_fingerprint = fingerprint(config)  # as given: `mtcore train` checks the same before ranks
    from mtcore.backend import PluginWarning, select_backend

    with warnings.catch_warnings():
        # Rank 0 prints the selection's notes in its first lines (_Loop.run), once for
        # the job instead of once per rank.
        warnings.simplefilter("ignore", PluginWarning)
        backend = select_backend(config.training.backend)
    if backend.device.type == "cpu" and "dtype" not in config.precision.model_fields_set:
        # bf16 matmuls are several times slower than fp32 on CPUs without AVX-512 BF16:
        # a CPU job is fp32 unless precision.dtype asks for another.
        config.precision = config.precision.model_copy(update={"dtype": "fp32"})
    prep = prepare(config, world, rank)
    config.precision.check_backend(backend)  # before any process group starts
    try:  # the collectives the context-parallel method moves K/V with
        check_backend_serves(prep.spec, backend, config.precision.mixed_precision().param_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if backend.device.type != "cpu":
        backend.device.set_device(local_device_index(backend, int(os.environ.get("LOCAL_RANK", 0))))
    if world > 1:
        backend.collective.init_process_group(timeout_s=config.training.collective_timeout_s)
        layout = ParallelLayout.build(prep.spec, backend.collective, rank, world)
    else:
        layout = ParallelLayout.single(prep.spec)
    elastic = ElasticRun.from_environment()

    def say(text: str) -> None:  # rank 0, before the loop's progress output exists
        if rank == 0:
            print(text, file=stream or sys.stdout, flush=True)

    try:
        if world > 1:  # on several nodes: which address each node's ranks bind
            for line in describe_nodes(backend, rank, world, backend.torch_device()):
                say(f"mtcore train: {line}")
        if config.training.self_check:
            verify_backend(backend, config, layout, rank, world, say)
        with StopSignal() as stop:  # a SIGTERM from here on ends in a checkpoint
            # Before anything reads or writes the checkpoint root (resume included). An
            # earlier incarnation of this job still holding it gets half the collective
            # timeout to let go (the other ranks wait for rank 0 in a collective).
            wait_s = config.training.collective_timeout_s / 2
            owner = claim_checkpoint_dir(
                config.checkpoint.dir, backend, rank, world, elastic.run_id, wait_s, say
            )
            try:
                if owner is not None and owner.notice:
                    say(owner.notice)
                return _Loop(
                    config, prep, layout, backend, rank == 0, stream, owner, elastic, stop,
                    run_fingerprint,
                ).run()  # fmt: skip
            finally:
                if owner is not None:
                    owner.release()
    finally:
        if world > 1:
            backend.collective.destroy()


def sample_group(layout: ParallelLayout, collective, device) -> SampleGroup:
    """This rank's model replica (tp x pp ranks): they read the same samples."""
    mp = layout.mp
    if mp.size == 1:
        return ALONE

    def any_of(flags: torch.Tensor) -> torch.Tensor:
        wide = flags.to(device=device, dtype=torch.int32)
        collective.all_reduce(wide, op="max", group=mp.group)
        return wide.cpu().bool()

    return SampleGroup(any_of, speaks=mp.rank == 0)


class _Loop:
    def __init__(
        self,
        config,
        prep: Prepared,
        layout,
        backend,
        is_main: bool,
        stream,
        owner=None,
        elastic: ElasticRun | None = None,
        stop: StopSignal | None = None,
        run_fingerprint: str | None = None,
    ):
        """``owner``: the job's claim on ``checkpoint.dir`` (``owner.claim``); ``elastic``: its
        run id and restart count; ``stop``: the installed ``StopSignal`` (None: none);
        ``run_fingerprint``: ``lineage.fingerprint`` of the config as given."""
        self.config, self.prep, self.layout, self.backend = config, prep, layout, backend
        self.stop = stop if stop is not None else StopSignal(signals=())
        self.is_main, self.t = is_main, config.training
        self.model_config = prep.model
        self.device = backend.torch_device()
        mp = config.precision.mixed_precision()
        self.engine = Engine(
            self.model_config,
            layout,
            backend,
            micro_batch_size=self.t.micro_batch_size,
            num_microbatches=prep.microbatches,
            optimizer=config.optimizer,
            precision=mp,
            seed=self.t.seed,
            schedule=config.parallel.schedule,
            zero=config.parallel.zero_stage,
            bucket_size=config.parallel.bucket_size,
            lora=config.finetune.lora,
        )
        self.guard = BadStepGuard(self.t.max_bad_steps, self.engine.optimizer.loss_scaler)
        self.progress = Progress(self.t.steps, config.logging.progress, stream)
        run_config = config.model_dump(mode="json")
        self.scalars = Scalars(
            config.logging.tensorboard_dir if is_main else None,
            run_config,
            wandb_settings(config) if is_main and config.logging.wandb else None,
        )
        self.flops = self.model_config.flops_per_step(self.t.global_batch_size)
        self.peak = peak_tflops(backend, mp.param_dtype)
        # Samples are split over dp (TrainConfig.check counts micro-batches per dp rank);
        # the ranks of a cp group read the same samples and each keeps its share of every
        # sequence (``_batch``), so the engine's counts over dp x cp are the global ones.
        dp, dp_rank = layout.size(Axis.DP), layout.coordinate(Axis.DP)
        self.cp, self.cp_rank = layout.cp, layout.coordinate(Axis.CP)
        self.loader_args = dict(
            micro_batch_size=self.t.micro_batch_size,
            global_batch_size=self.t.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp,
            seed=self.t.seed,
        )
        if prep.data.loader_takes_group:
            self.loader_args["group"] = sample_group(layout, backend.collective, self.device)
        self.train_loader = prep.data.loader(prep.data.train, **self.loader_args)
        self.result = TrainResult()
        self._hosts: list[str] | None = None  # every rank's host, for the straggler report
        self.profiler = StepProfiler(
            config.logging.profile, backend, layout.rank, layout.world_size, self.say
        )
        self.checkpoints = TrainerCheckpoints(
            config, self.engine, prep, self.say, owner, elastic, run_fingerprint
        )
        self.result.start_step = self.checkpoints.restore(self.train_loader)  # collective
        self.decay_steps = self._schedule_length()

    def _schedule_length(self) -> int:
        """The lr schedule's length: ``optimizer.decay_steps``, else the first run's
        ``training.steps``, kept by every resumed run (so raising ``training.steps`` to
        train on does not reshape the schedule). Written into the config that the
        checkpoints save, so the next resume finds it."""
        opt = self.config.optimizer
        length = opt.decay_steps
        if length is None and self.result.start_step > 0:
            saved = self._saved_config(self.result.start_step)
            # Checkpoints from before schedules were recorded: their run's steps.
            length = (saved.get("optimizer") or {}).get("decay_steps") or (
                saved.get("training") or {}
            ).get("steps")
            if isinstance(length, int) and length != self.t.steps:
                self.say(
                    f"lr schedule: {opt.schedule} over {length} steps as in the checkpoint's "
                    f"run (set optimizer.decay_steps to change it)"
                )
        if not isinstance(length, int):
            length = self.t.steps
        self.config.optimizer = opt.model_copy(update={"decay_steps": length})
        return length

    def _saved_config(self, step: int) -> dict:
        """The config.yaml of the checkpoint this run resumed from ({} if none is found)."""
        ck = self.config.checkpoint
        for base in (ck.dir if ck.resume else None, ck.load):
            if base is None:
                continue
            root = Path(base).expanduser()
            for path in (root / "config.yaml", root / step_dir_name(step) / "config.yaml"):
                if path.is_file():
                    loaded = yaml.safe_load(path.read_text())
                    return loaded if isinstance(loaded, dict) else {}
        return {}

    def say(self, text: str) -> None:
        if self.is_main:
            self.progress.line(text)

    def run(self) -> TrainResult:
        start = time.perf_counter()
        if self.result.start_step >= self.t.steps:  # e.g. a finished job restarted with resume
            self.say(
                f"nothing to train: the checkpoint is at step {self.result.start_step} and "
                f"training.steps is {self.t.steps} (raise training.steps to train further)"
            )
            self.progress.close()
            self.scalars.close()
            return self.result
        s, tokens_per_step = self.layout.spec, self.t.global_batch_size * self.model_config.seq_len
        for note in self.backend.selection_notes:
            self.say(f"mtcore train: warning: {note}")
        self.say(
            f"mtcore train: {self.model_config.describe()} | {self.layout.world_size} ranks: "
            f"tp={s.tp} pp={s.pp} vpp={s.vpp} dp={s.dp} "
            f"cp={s.cp}{f' ({s.cp_method})' if s.cp > 1 else ''} sp={s.sequence_parallel} "
            f"zero={self.config.parallel.zero_stage} | {self.config.precision.dtype} on "
            f"{self.backend.name} | {self.prep.microbatches} micro-batches x "
            f"{self.t.micro_batch_size} per dp rank, {tokens_per_step} tokens/step"
        )
        if (m := self.model_config.experts) is not None:
            self.say(
                f"mixture of experts: {m.num_experts} experts, top-{m.top_k}, in "
                f"{self.model_config.num_moe_layers} of {self.model_config.num_layers} layers, ep={s.ep}, "
                f"{self.model_config.num_params(active=True) / 1e6:.2f}M params active per token, "
                f"{m.dispatcher} dispatch, "
                + ("dropless" if m.capacity_factor is None else f"capacity {m.capacity_factor}")
            )
        if (lora := self.config.finetune.lora) is not None:
            params = [p for chunk in self.engine.chunks for p in chunk.parameters()]
            trained = sum(p.numel() for p in params if p.requires_grad)
            self.say(
                f"lora: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on "
                f"{', '.join(lora.targets)} | rank 0 trains {trained / 1e6:.3f}M of its "
                f"{sum(p.numel() for p in params) / 1e6:.2f}M params; the rest is frozen"
            )
        if (fp8 := self.config.precision.fp8_config()) is not None:
            paths = "/".join(sorted(set(fp8.paths(self.backend.fp8).values())))
            self.say(f"fp8 ({fp8.format}): {fp8.describe()} | block linear GEMMs: {paths}")
        with collected_every(self.t.gc_interval):
            self._loop()
        self.profiler.close()  # when training ended inside the traced steps
        self._save(self.t.steps, final=True)
        self.progress.close()
        self.scalars.close()
        self.result.wall_s = time.perf_counter() - start
        ran, start = self.t.steps - self.result.start_step, self.result.start_step
        since = f" (steps {start + 1}-{self.t.steps}, resumed at {start})" if start else ""
        self.say(f"done: {ran} steps{since} in {self.result.wall_s:.1f} s")
        return self.result

    def _loop(self) -> None:
        window_t, window_cpu, window_steps = 0.0, 0.0, 0
        window_trained = 0.0  # next-token targets trained (labels != -100)
        window_busy = window_wait = 0.0  # the pipeline's compute and communication time
        for step in range(self.result.start_step + 1, self.t.steps + 1):
            t0, cpu0 = time.perf_counter(), time.process_time()
            if self.t.gc_interval and step % self.t.gc_interval == 0:
                gc.collect(1)  # timed with the step: it is the step's cost
            with self.profiler.step(step):  # logging.profile: the traced steps
                self.engine.set_lr(lr := self.config.optimizer.lr_at(step, self.decay_steps))
                with phase("data", "data"):
                    batches = self._batch(self.train_loader)
                out = self.engine.train_step(batches, self.stop.requested)
            window_t += time.perf_counter() - t0
            window_cpu += time.process_time() - cpu0  # every thread of this process
            window_steps += 1
            window_trained += (out.counts or {}).get("lm", 0.0)
            pipeline = self.engine.last_pipeline  # compute: CPU time on the host (stragglers)
            window_busy += pipeline.busy_cpu_s if self.device.type == "cpu" else pipeline.busy_s
            window_wait += pipeline.wait_s
            self.result.losses.append(out.loss)
            if out.moe is not None:
                self.result.moe.append(out.moe)
            message = self.guard.observe(step, out)
            if message:
                self.result.skipped_steps.append(step)
                self.say(message)
            first = self.result.start_step + 1  # the first step of this run (resumed or not)
            if step % self.config.logging.interval == 0 or step in (first, self.t.steps):
                means = (window_t, window_cpu, window_trained, window_busy, window_wait)
                self._log(step, out, lr, *(total / window_steps for total in means))
                window_t, window_cpu, window_steps, window_trained = 0.0, 0.0, 0, 0.0
                window_busy = window_wait = 0.0
            elif self.is_main:
                self.progress.update(step, f"loss {out.loss:.4f}")
            if self._due(step, self.t.eval_interval):
                self._evaluate(step)
            if out.stop and step != self.t.steps:
                self._preempted(step)
            if self._due(step, self.config.checkpoint.interval) and step != self.t.steps:
                self._save(step)
            self.checkpoints.poll()  # commits a finished asynchronous save

    def _preempted(self, step: int) -> None:
        """Every rank: commit ``step`` (collective), then raise ``Preempted``."""
        saved = None
        if self.config.checkpoint.dir is not None and step > self.result.start_step:
            saved = self.checkpoints.save(step, self.train_loader, final=True)
        self.progress.close()
        self.scalars.close()
        got = self.stop.received
        name = got.name if got is not None else "a signal to another rank"
        raise Preempted(step, name, saved, self.stop.since() if got is not None else None)

    def _due(self, step: int, interval: int) -> bool:
        return (interval > 0 and step % interval == 0) or step == self.t.steps

    def _batch(self, loader) -> list[dict]:
        """This dp rank's micro-batches of the next global batch, on the device: this cp
        rank's share of each sequence under context parallelism."""
        batches = [
            {name: t.to(self.device) for name, t in next(loader).items()}
            for _ in range(self.prep.microbatches)
        ]
        lengths = family_of(self.model_config).sequence_lengths(self.model_config)
        return [shard_batch(batch, lengths, self.cp, self.cp_rank) for batch in batches]

    def _log(
        self, step: int, out: StepOutcome, lr: float, step_s: float, cpu_s: float, trained=0.0,
        busy_s=0.0, wait_s=0.0,
    ) -> None:  # fmt: skip
        """``step_s``: this rank's mean wall time per step over the interval; ``cpu_s``:
        its CPU time per step (``time.process_time``, all threads), summed over ranks here;
        ``trained``: next-token targets trained per step (labels not -100, all ranks)."""
        memory, cpu_s, per_rank = self._over_ranks(cpu_s, busy_s, wait_s)
        tokens_s = self.t.global_batch_size * self.model_config.seq_len / step_s
        tflops = self.flops / step_s / self.layout.world_size / 1e12
        norm = f"{out.grad_norm:.3f}" if out.grad_norm is not None else "n/a"
        trained_part = ""
        if out.counts and "lm" in out.counts:  # a next-token loss: how many targets it trained
            trained_part = f" | {trained:,.0f} trained tokens/step"
        terms = out.terms if out.terms and len(out.terms) > 1 else {}  # one term is the loss
        parts = ", ".join(f"{name} {value:.4f}" for name, value in terms.items())
        parts = f" ({parts})" if parts else ""
        self.say(
            f"step {step}/{self.t.steps} | loss {out.loss:.4f}{parts} | lr {lr:.2e} | grad norm {norm} | "
            f"{tokens_s:,.0f} tokens/s{trained_part} | {tflops:.3f} TFLOP/s/rank | MFU "
            f"{format_mfu(tflops, self.peak)} | mem {format_bytes(memory)} | {step_s:.2f} s/step | "
            f"cpu {cpu_s * 1e3:.0f} ms/step"
        )
        fp16 = self.config.precision.dtype == "fp16"
        scalars = {
            "train/loss": out.loss,
            "train/lr": lr,
            "train/grad_norm": out.grad_norm,
            "train/tokens_per_s": tokens_s,
            "train/trained_tokens_per_step": trained if trained_part else None,
            "train/tflops_per_rank": tflops,
            "train/mfu": tflops / self.peak if self.peak else None,
            "train/memory_bytes": float(memory),
            "train/step_s": step_s,
            "train/cpu_step_s": cpu_s,
            "train/loss_scale": out.loss_scale if fp16 else None,
            **{f"train/{name}": value for name, value in terms.items()},
        }
        scalars.update(self._stragglers(step, *per_rank))
        if out.moe is not None:
            self.say(f"step {step}/{self.t.steps} | {format_moe(out.moe)}")
            scalars.update({f"moe/{key}": value for key, value in out.moe.items()})
        self.scalars.add(step, scalars)

    def _over_ranks(self, cpu_s: float, busy_s: float = 0.0, wait_s: float = 0.0):
        """(the largest peak memory of any rank, the sum of the ranks' ``cpu_s``, every
        rank's (compute, wait, stage) for the straggler report) in one all-reduce: each
        rank writes its figures into its own column, zeros elsewhere, so the max over
        ranks holds every rank's figures."""
        n, rank = self.layout.world_size, self.layout.rank
        t = torch.zeros(5, n, device=self.device)
        t[0, rank] = float(self.backend.device.max_memory_allocated())
        t[1, rank] = cpu_s
        t[2, rank], t[3, rank] = busy_s, wait_s
        t[4, rank] = self.layout.coordinate(Axis.PP)
        if n > 1:
            self.backend.collective.all_reduce(t, op="max")
        rows = t[2:].tolist()
        per_rank = (rows[0], rows[1], [int(s) for s in rows[2]])
        return int(t[0].max().item()), float(t[1].sum().item()), per_rank

    def _stragglers(self, step: int, compute, wait, stages) -> dict[str, float]:
        """Name each rank computing slower than ``logging.straggler_factor`` times its
        stage's median (mtcore.training.stragglers); TensorBoard gets the slowest ratio."""
        factor = self.config.logging.straggler_factor
        if factor is None or self.layout.world_size == 1:
            return {}
        if self._hosts is None:  # collective, at every rank's first log line
            self._hosts = stragglers.host_names(
                self.backend.collective, self.layout.world_size, self.device
            )
        found = stragglers.find(compute, wait, stages, self._hosts, factor)
        for straggler in found:
            self.say(straggler.line(step))
        return {
            "stragglers/count": float(len(found)),
            "stragglers/slowest_ratio": max((s.ratio for s in found), default=None),
        }

    def _evaluate(self, step: int) -> None:
        if self.prep.data.valid is None:
            return
        # A fresh loader with a fixed seed: the same batches at every evaluation, drawn
        # from the whole validation split (in order, they would be its first file or two).
        loader = self.prep.data.loader(self.prep.data.valid, **self.loader_args)
        batches = [mb for _ in range(self.t.eval_batches) for mb in self._batch(loader)]
        values = self.engine.evaluate(batches)
        loss = values["loss"]
        self.result.val_losses.append((step, loss))
        self.result.val_metrics.append((step, values))
        extra = {name: value for name, value in values.items() if name != "loss"}
        single = len(extra) == 1  # one loss term and no metrics: the loss itself
        parts = [f"eval step {step}", f"val loss {loss:.4f}"]
        if single:  # a perplexity means something for one cross-entropy term only
            parts.append(f"val ppl {perplexity(loss):.2f}")
        else:
            parts += [f"{name} {value:.4f}" for name, value in extra.items()]
        self.say(" | ".join(parts))
        scalars = {f"val/{name}": value for name, value in values.items()}
        self.scalars.add(step, {**scalars, "val/ppl": perplexity(loss) if single else None})

    def _save(self, step: int, final: bool = False) -> None:
        root = self.config.checkpoint.dir
        want_sample = final and self.t.sample_prompt is not None and self.t.sample_tokens > 0
        want_sample = want_sample and family_of(self.model_config).capabilities.generates
        if root is not None and step > self.result.start_step:  # collective: every rank
            self.result.checkpoint = self.checkpoints.save(step, self.train_loader, final)
        if not want_sample:
            return
        weights = self.engine.full_state_dict()  # collective: every rank
        if self.is_main:
            tok, prompt = self.prep.data.tokenizer, self.t.sample_prompt
            self.result.sample = sample(
                self.model_config, weights, tok, prompt, self.t.sample_tokens, self.backend
            )
            self.say(f"sample ({self.t.sample_tokens} tokens after {self.t.sample_prompt!r}):")
            self.say(self.result.sample)


@contextlib.contextmanager
def collected_every(interval: int):
    """Python's automatic garbage collection off while the loop runs (``interval`` > 0:
    the loop collects generations 0 and 1 every ``interval`` steps itself, as torchtitan's
    ``gc_freq`` does), and back as it was afterwards. One full collection first."""
    if not interval:
        yield
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def sample(config: FamilyConfig, weights, tokenizer, prompt: str, n: int, backend, top_k=20) -> str:
    """A continuation of ``prompt`` by the one-process model with ``weights`` (seeded top-k)."""
    family = family_of(config)
    model = family.one_process(config, backend)
    model.load_state_dict(weights, strict=True)
    model.train(False)
    generator = torch.Generator(device=backend.torch_device()).manual_seed(0)
    return family.generate(model, tokenizer, prompt, n, top_k=top_k, generator=generator)
