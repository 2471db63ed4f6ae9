"""``plan(config, gpus, hardware)``: per-rank memory and predicted step time of one layout.

The layout is checked first by ``TrainConfig.check`` (what ``mtcore train`` runs),
so a layout the trainer would reject raises the trainer's own error. Then, per
pipeline rank: the parameters it holds, the activations of the micro-batches its
schedule keeps in flight, and the time of one micro-batch through its chunks;
the slowest rank sets the pipeline's pace (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtcore.parallel.pipeline.table import schedule_entry
from mtcore.plan import data_parallel, network, timing
from mtcore.plan.data_parallel import Fsdp
from mtcore.plan.hardware import Hardware
from mtcore.plan.lora import adapter_params
from mtcore.plan.memory import (
    dtype_bytes,
    heads_in_flight,
    in_flight,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    state_bytes_per_param,
)
from mtcore.plan.options import DP_OVERLAP, Options, OptionsError
from mtcore.plan.shapes import ModelShape, model_shape, stage_params
from mtcore.plan.stage import (
    Stage,
    microbatch_time,
    rank_blocks,
    recompute_flops,
    replicated_grad_seconds,
    transient,
    weight_grad_seconds,
)

__all__ = ["DP_OVERLAP", "Options", "OptionsError", "PlacementError", "Plan", "plan"]


def pipeline_bubble(
    schedule: str, per_stage: list[float], weight_grads: list[float], slow: int, vpp: int
) -> float:
    """Seconds of a step no stage computes: the schedule table's formula
    (``ScheduleEntry.bubble``; 1F1B: the sum of the stages' micro-batch times less the
    slowest's, divided by v when interleaved; ZB-H1 fills the drain with W passes)."""
    if len(per_stage) == 1:
        return 0.0
    return schedule_entry(schedule).bubble(per_stage, weight_grads, slow, vpp)


class PlacementError(ValueError):
    """A layout whose tensor-parallel (or ep x tp) groups would span nodes."""


@dataclass
class RankMemory:
    """Bytes on one pipeline rank (the same on every tp/cp/dp rank of that stage)."""

    stage: int
    params: int
    expert_params: int
    weights: float
    grads: float
    master: float
    optimizer: float
    activations: float
    transient: float
    in_flight: float

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer

    @property
    def peak(self) -> float:
        return self.state + self.activations + self.transient


@dataclass
class StepTime:
    """Seconds of one optimizer step, split by cause (the slowest pipeline rank's)."""

    compute: float
    recompute: float
    memory_bound: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    dp_exposed: float
    optimizer: float
    tied_comm: float = 0.0  # the tied embedding's gradient, first and last stage, after backward
    overhead: float = (
        0.0  # the software's fixed cost a micro-batch (Hardware.microbatch_overhead_us)
    )

    @property
    def exposed_comm(self) -> float:
        """Communication the step waits for: tp, cp, ep, pp, dp and the tied embedding's."""
        comm = self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
        return comm + self.dp_exposed + self.tied_comm

    @property
    def total(self) -> float:
        busy = self.compute + self.recompute + self.memory_bound + self.overhead
        return busy + self.exposed_comm + self.bubble + self.optimizer


@dataclass
class Plan:
    """One layout's prediction; ``to_dict`` is what ``--json`` prints."""

    layout: dict
    hardware: str
    gpus: int
    family: str
    params: int
    microbatches: int
    ranks: list[RankMemory]
    time: StepTime
    memory_limit: float
    tokens_per_step: int
    model_flops: float
    hardware_flops: float
    peak_flops: float
    notes: list[str] = field(default_factory=list)
    assumed: dict[str, str] = field(default_factory=dict)
    # per pipeline rank, one micro-batch's seconds by cause, and its weight-gradient share:
    # what the planned trace (mtcore.plan.trace) lays out along the schedule
    stage_seconds: list[dict] = field(default_factory=list)
    weight_seconds: list[float] = field(default_factory=list)

    @property
    def peak_rank(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak_memory(self) -> float:
        return self.peak_rank.peak

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.memory_limit

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per accelerator: recompute included (Narayanan et al.'s count)."""
        return self.hardware_flops / self.time.total / self.gpus / 1e12

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.time.total / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.time.total / self.gpus / self.peak_flops

    def to_dict(self) -> dict:
        ranks = [{**asdict(r), "state": r.state, "peak": r.peak} for r in self.ranks]
        return {
            "layout": self.layout,
            "hardware": self.hardware,
            "gpus": self.gpus,
            "family": self.family,
            "params": self.params,
            "microbatches": self.microbatches,
            "memory": {
                "limit_bytes": self.memory_limit,
                "peak_bytes": self.peak_memory,
                "fits": self.fits,
                "per_stage": ranks,
            },
            "time_s": {**asdict(self.time), "total": self.time.total},
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "assumed": self.assumed,
            "notes": self.notes,
        }


def layout_of(config) -> dict:
    p = config.parallel
    keys = ("tp", "cp", "pp", "vpp", "ep", "sequence_parallel", "zero1", "schedule", "cp_method")
    keys += ("first_stage_layers", "last_stage_layers")
    out = {k: getattr(p, k) for k in keys}
    out["micro_batch"] = config.training.micro_batch_size
    out["global_batch"] = config.training.global_batch_size
    out["recompute"] = getattr(config.model, "recompute", "none")
    out["dtype"] = config.precision.dtype
    return out


def plan(config, gpus: int, hardware: Hardware, options: Options | None = None) -> Plan:
    """The prediction for ``config`` on ``gpus`` accelerators of ``hardware``.

    Raises the trainer's own ``LayoutError``/``SplitError`` for a layout it would
    reject, and ``NotModelled`` for a family the planner has no shape for.
    """
    options = options or Options()
    config = with_data_vocab(config)
    spec, microbatches = config.check(gpus)
    shape = model_shape(config.model)
    return _plan(config, spec, microbatches, shape, gpus, hardware, options)


def with_data_vocab(config):
    """``config`` with ``model.vocab_size`` taken from ``data.vocab_size`` when unset (the
    size the trainer's tokenizer is trained to, padded as the trainer pads it)."""
    vocab = getattr(config.data, "vocab_size", None)
    if config.model.vocab_size is None and vocab:
        return config.model_copy(update={"model": config.model.with_vocab(vocab)})
    return config


def check_placement(spec, hardware: Hardware, options: Options) -> None:
    """``PlacementError`` unless every tp group and every ep x tp block lies in one node
    (``Options.cross_node`` allows it: the group is then priced on the network); and
    no expert parallel under the ``tp-cp-pp-dp`` rank order (its ep groups are not
    modelled)."""
    if spec.ep > 1 and options.rank_order != network.RANK_ORDERS[0]:
        raise PlacementError(
            f"rank order {options.rank_order} is planned without expert parallel (ep = "
            f"{spec.ep}); use {network.RANK_ORDERS[0]} for ep > 1"
        )
    if options.cross_node:
        return
    nodes = hardware.gpus_per_node
    for what, size in (("tp", spec.tp), ("ep x tp", spec.ep * spec.tp)):
        if not network.fits(size, 1, nodes):
            raise PlacementError(
                f"{what} = {size} does not fit the {nodes}-accelerator nodes of "
                f"{hardware.name} (a group must divide a node, or some group spans two); "
                "allow groups across nodes with --cross-node (priced on the network)"
            )


@dataclass(frozen=True)
class _Setting:
    """What every step of one plan reads: the checked layout, the model, the software."""

    config: object
    spec: object  # the trainer's checked layout (tp, cp, pp, vpp, ep, dp, ...)
    microbatches: int
    shape: ModelShape
    hardware: Hardware
    options: Options
    act_bytes: int  # the compute dtype's bytes an element
    zero: int
    products: timing.Products
    layer_counts: list[int]  # layers per virtual stage

    @property
    def micro_batch(self) -> int:
        return self.config.training.micro_batch_size

    @property
    def schedule(self) -> str:
        return self.config.parallel.schedule

    @property
    def fused(self) -> bool:
        return self.options.flash(self.hardware)

    @property
    def grad_bytes(self) -> int:
        return self.options.grad_bytes

    @property
    def dense_shards(self) -> int:
        """Ranks the dense parameters' state is sharded over (dp x cp)."""
        return self.spec.dp * self.spec.cp

    @property
    def expert_shards(self) -> int:
        """Ranks an expert's state is sharded over: its expert-data-parallel group."""
        return max(1, self.dense_shards // self.spec.ep)


@dataclass(frozen=True)
class _StageWork:
    """One pipeline rank's memory and one micro-batch's time through it."""

    memory: RankMemory
    seconds: dict  # by cause, before overlap
    weight_grad: float  # the W share of its compute (zero-bubble schedules)
    largest_unit: float  # the most parameters one ZeRO-3 gathered unit holds
    replicated_grads: float  # seconds a step: tp all-reduce of whole-on-every-rank weights


def _plan(config, spec, microbatches, shape: ModelShape, gpus, hardware, options) -> Plan:
    check_placement(spec, hardware, options)
    setting, notes = _setting(config, spec, microbatches, shape, hardware, options)
    timed: dict[Stage, dict] = {}  # middle stages repeat: time each kind of stage once
    work = [_stage_work(setting, rank, timed) for rank in range(spec.pp)]
    stage_seconds = _overlapped(setting, [dict(w.seconds) for w in work])
    time = _step_time(setting, work, stage_seconds)
    global_batch = config.training.global_batch_size
    model_flops = config.model.flops_per_step(global_batch)
    recomputed = recompute_flops(shape, shape.recompute, options.kept) * global_batch
    return Plan(
        layout=layout_of(config) | {"dp": spec.dp, "zero": setting.zero},
        hardware=hardware.name,
        gpus=gpus,
        family=shape.family,
        params=shape.total_params,
        microbatches=microbatches,
        ranks=[w.memory for w in work],
        time=time,
        memory_limit=hardware.memory_bytes,
        tokens_per_step=global_batch * shape.seq_len,
        model_flops=model_flops,
        hardware_flops=model_flops + recomputed,
        peak_flops=hardware.peak_flops(config.precision.dtype),
        notes=notes + _model_notes(shape, setting.act_bytes),
        assumed=options.assumed(config, hardware)
        | _stage_layers(setting.layer_counts, spec.pp, spec.vpp),
        stage_seconds=stage_seconds,
        weight_seconds=[w.weight_grad for w in work],
    )


def _setting(config, spec, microbatches, shape, hardware, options) -> tuple[_Setting, list[str]]:
    """The plan's ``_Setting`` and the notes on what it assumed about precision, ZeRO
    and LoRA."""
    dtype = config.precision.dtype
    block_dtype, notes = _block_dtype(config, hardware)
    products = timing.Products(
        hardware, dtype, block_dtype, config.precision.fp8_recipe, options.fp8_experts
    )
    notes.append(products.note())
    zero = options.zero_stage(config)
    if zero != 3 and options.fsdp != Fsdp():
        raise OptionsError(f"the fsdp switches describe ZeRO-3 (--zero 3), not ZeRO-{zero}")
    if zero == 3:
        notes.append(
            "ZeRO-3: every parameter sharded, as FSDP shards them; mtcore's parallel.zero 3 "
            "shards the blocks' and keeps the embedding and head whole"
        )
    lora = config.finetune.lora
    if lora is not None:
        notes.append(f"lora: rank {lora.rank} on {', '.join(lora.targets)}; the base is frozen")
        notes += sorted({adapter_params(bl, lora, spec.tp)[1] for bl in shape.blocks} - {None})
    counts = shape.counts(spec.pp, spec.vpp, spec.first_stage_layers, spec.last_stage_layers)
    setting = _Setting(
        config=config,
        spec=spec,
        microbatches=microbatches,
        shape=shape,
        hardware=hardware,
        options=options,
        act_bytes=dtype_bytes(dtype),
        zero=zero,
        products=products,
        layer_counts=counts,
    )
    return setting, notes


def _block_dtype(config, hardware: Hardware) -> tuple[str, list[str]]:
    """The dtype the blocks' products run in: fp8 under ``precision.fp8`` where the
    hardware has an fp8 peak, else the compute dtype; with a note saying which."""
    dtype = config.precision.dtype
    if config.precision.fp8 is None:
        return dtype, []
    if "fp8" in hardware.peak_tflops:
        return "fp8", [
            "fp8: the blocks' column- and row-parallel linears run at the fp8 peak (the "
            "experts too under --fp8-experts), with their quantization's memory traffic; "
            "fp8_first_last_high_precision is not modelled"
        ]
    return dtype, [f"fp8: {hardware.name} gives no fp8 peak; products at the {dtype} peak"]


def _stage_work(setting: _Setting, rank: int, timed: dict) -> _StageWork:
    """Pipeline rank ``rank``'s memory and its micro-batch's time (``timed``: the
    micro-batch seconds of each kind of stage seen so far)."""
    spec, shape = setting.spec, setting.shape
    pp, vpp = spec.pp, spec.vpp
    stage = Stage(
        rank_blocks(shape, setting.layer_counts, pp, vpp, rank), rank == 0, rank == pp - 1
    )
    unit = _largest_unit(shape, stage, spec.tp, spec.ep)
    args = (shape, stage, setting.micro_batch, spec)
    if stage not in timed:
        timed[stage] = _microbatch_seconds(setting, stage)
    return _StageWork(
        memory=_rank_memory(setting, stage, rank, unit),
        seconds=timed[stage],
        weight_grad=weight_grad_seconds(*args, setting.products),
        largest_unit=unit,
        replicated_grads=replicated_grad_seconds(
            shape, stage, spec, setting.hardware, setting.grad_bytes
        ),
    )


def _rank_memory(setting: _Setting, stage: Stage, rank: int, largest_unit: float) -> RankMemory:
    """Bytes on ``rank``: its parameters' state (ZeRO-sharded), the activations of the
    micro-batches its schedule keeps in flight, and its transient peak."""
    spec, shape, e = setting.spec, setting.shape, setting.act_bytes
    dense, experts, frozen = _trained_params(setting, stage)
    dense_bytes, expert_bytes = (
        state_bytes_per_param(
            setting.config.precision.dtype, setting.zero, shards, setting.grad_bytes
        )
        for shards in (setting.dense_shards, setting.expert_shards)
    )

    def state(part: str) -> float:
        return dense * dense_bytes[part] + experts * expert_bytes[part]

    grads = state("grads")
    if setting.zero == 3 and setting.options.fsdp.reduce == "step":
        grads = (dense + experts) * setting.grad_bytes  # unsharded until the step's reduction

    held = in_flight(setting.schedule, spec.pp, spec.vpp, rank, setting.microbatches)
    per_microbatch = sum(
        n
        * layer_activation_bytes(
            bl,
            setting.micro_batch,
            spec.tp,
            spec.cp,
            spec.sequence_parallel,
            shape.recompute,
            setting.fused,
            e,
            setting.options.kept,
        )
        for bl, n in stage.blocks
        if bl.keeps_activations  # a block run under no_grad keeps nothing
    )
    return RankMemory(
        stage=rank,
        params=round(dense),
        expert_params=round(experts),
        weights=(dense + frozen) * dense_bytes["params"] + experts * expert_bytes["params"],
        grads=grads,
        master=state("master"),
        optimizer=state("optimizer"),
        activations=per_microbatch * held,
        transient=_transient(setting, stage, dense + experts, largest_unit),
        in_flight=held,
    )


def _trained_params(setting: _Setting, stage: Stage) -> tuple[float, float, float]:
    """``(dense, experts, frozen)`` parameters one tp rank of ``stage`` holds; under LoRA
    the base is frozen and the adapters alone train."""
    spec, shape = setting.spec, setting.shape
    holds = stage_params(shape, stage.blocks, spec.tp, spec.ep, spec.pp, stage.first, stage.last)
    lora = setting.config.finetune.lora
    if lora is None:
        return holds.trained, holds.experts, holds.frozen
    adapters = sum(
        n * adapter_params(bl, lora, spec.tp)[0] for bl, n in stage.blocks if not bl.frozen
    )
    return adapters, 0.0, holds.frozen + holds.trained + holds.experts


def _transient(setting: _Setting, stage: Stage, trained: float, largest_unit: float) -> float:
    """The stage's peak beyond state and kept activations (``stage.transient``); under
    ZeRO-2/3 also the gradient bucket being reduced, under ZeRO-3 a gathered unit and
    the next one."""
    spec, shape = setting.spec, setting.shape
    heads = heads_in_flight(setting.schedule, spec.pp, spec.vpp, setting.microbatches)
    extra = transient(
        shape,
        stage,
        setting.micro_batch,
        spec,
        shape.recompute,
        setting.fused,
        setting.act_bytes,
        heads,
    )
    if setting.zero >= 2 and setting.dense_shards > 1:
        extra += setting.grad_bytes * min(setting.config.parallel.bucket_size, trained)
        if setting.zero == 3:
            fsdp = setting.options.fsdp
            gathered = (1 + fsdp.prefetch) * largest_unit if fsdp.reshard else trained
            extra += setting.act_bytes * gathered
    return extra


def _microbatch_seconds(setting: _Setting, stage: Stage) -> dict:
    """One micro-batch's seconds through ``stage`` by cause (``stage.microbatch_time``)."""
    shape = setting.shape
    return microbatch_time(
        shape,
        stage,
        setting.micro_batch,
        setting.spec,
        setting.hardware,
        shape.recompute,
        setting.fused,
        setting.act_bytes,
        setting.products,
        setting.options.kept,
        setting.options.rank_order,
        setting.options.moe_node_limit,
    )


def _overlapped(setting: _Setting, stage_seconds: list[dict]) -> list[dict]:
    """``stage_seconds`` with the communication of ``Options.overlapped`` axes hidden
    behind the micro-batch's compute as far as it lasts (in the order given)."""
    for seconds in stage_seconds:
        busy = seconds["compute"] + seconds["recompute"]
        for axis in setting.options.overlapped:
            key = f"{axis}_comm"
            seconds[key] = max(0.0, seconds[key] - busy)
            busy = max(0.0, busy - seconds[key])
    return stage_seconds


def _step_time(setting: _Setting, work: list[_StageWork], stage_seconds: list[dict]) -> StepTime:
    """The step of the slowest pipeline rank: its micro-batches, the pipeline's fill and
    drain, the data-parallel traffic it waits for, the optimizer and the tied embedding."""
    spec, m = setting.spec, setting.microbatches
    per_stage = [sum(seconds.values()) for seconds in stage_seconds]
    slow = max(range(spec.pp), key=lambda r: per_stage[r])
    one = stage_seconds[slow]
    weight_grads = [w.weight_grad for w in work]
    dp_traffic, dp_exposed = _data_parallel(setting, work[slow], one["compute"])
    return StepTime(
        compute=m * one["compute"],
        recompute=m * one["recompute"],
        memory_bound=m * one["memory_bound"],
        tp_comm=m * one["tp_comm"] + work[slow].replicated_grads,
        cp_comm=m * one["cp_comm"],
        ep_comm=m * one["ep_comm"],
        pp_comm=m * one["pp_comm"],
        bubble=pipeline_bubble(setting.schedule, per_stage, weight_grads, slow, spec.vpp),
        dp_comm=dp_traffic.total(m, setting.zero, setting.options.fsdp),
        dp_exposed=dp_exposed,
        optimizer=_optimizer_seconds(setting, work[slow].memory),
        tied_comm=_tied_embedding_seconds(setting),
        overhead=m * one["overhead"],
    )


def _data_parallel(setting: _Setting, slowest: _StageWork, compute: float):
    """The slowest rank's dp traffic (``data_parallel.traffic``) and the seconds of it the
    step waits for, its micro-batch's compute split a third forward, two thirds backward."""
    spec, memory = setting.spec, slowest.memory
    traffic = data_parallel.traffic(
        memory.params,
        memory.expert_params,
        slowest.largest_unit,
        spec,
        setting.hardware,
        setting.act_bytes,
        setting.grad_bytes,
        setting.config.parallel.bucket_size,
        setting.zero,
        setting.options.rank_order,
    )
    backward, forward = compute * 2 / 3, compute / 3
    exposed = data_parallel.exposed(
        traffic,
        setting.zero,
        setting.options.dp_overlap,
        spec.pp,
        setting.microbatches,
        forward,
        backward,
        setting.options.fsdp,
    )
    return traffic, exposed


def _optimizer_seconds(setting: _Setting, memory: RankMemory) -> float:
    """AdamW's step over the rank's (ZeRO-1+: its shard's) parameters, memory-bound:
    28 bytes of fp32 state and gradient traffic an element, plus the compute-dtype copy."""
    sharded = setting.zero >= 1
    elements = memory.params / (setting.dense_shards if sharded else 1)
    elements += memory.expert_params / (setting.expert_shards if sharded else 1)
    return timing.memory_bound(setting.hardware, elements * (28 + setting.act_bytes))


def _tied_embedding_seconds(setting: _Setting) -> float:
    """A tied word embedding's gradient summed over its copies on the first and last
    pipeline stage, once a step."""
    spec, shape = setting.spec, setting.shape
    if not (shape.tied and spec.pp > 1):
        return 0.0
    embedding = setting.grad_bytes * shape.vocab * shape.hidden / spec.tp
    stride = (spec.pp - 1) * network.pp_stride(spec, setting.options.rank_order)
    return network.all_reduce(setting.hardware, embedding, 2, stride)


def _model_notes(shape: ModelShape, act_bytes: int) -> list[str]:
    notes = []
    if any(bl.experts for bl in shape.blocks):
        notes.append("MoE: routing assumed balanced (every expert gets top_k/E of the tokens)")
    if any(bl.latent for bl in shape.blocks):
        notes.append(_latent_cache_note(shape, act_bytes))
    return notes


def _stage_layers(counts: list[int], pp: int, vpp: int) -> dict[str, str]:
    per_rank = [sum(counts[c * pp + r] for c in range(vpp)) for r in range(pp)]
    if len(set(per_rank)) == 1:
        return {"stage layers": f"{per_rank[0]} on each of {pp}"}
    middle = sorted(set(per_rank[1:-1]))
    between = f" / {'-'.join(map(str, middle))} x {pp - 2} / " if middle else " / "
    return {"stage layers": f"{per_rank[0]}{between}{per_rank[-1]}"}


def _latent_cache_note(shape: ModelShape, e: int) -> str:
    """Latent attention's generation cache per token, against every head's keys and values."""
    cache = kv_cache_bytes_per_token(shape.blocks, e)
    heads = sum(
        e * bl.heads * (bl.latent.qk_dim + bl.latent.v_dim) for bl in shape.blocks if bl.latent
    )
    return (
        f"latent attention: a generation KV cache keeps {cache / 1e3:.2f} kB per token "
        f"(latent and rope key per layer), {heads / cache:.1f}x less than every head's keys "
        "and values"
    )


def _largest_unit(shape: ModelShape, stage: Stage, tp: int, ep: int) -> float:
    """The most parameters one ZeRO-3 gathered unit holds on a tp rank of ``stage``: a
    block, the embedding (first stage) or the head (last)."""
    units = [bl.tp_rank_weights(tp) + bl.expert_weights() / (tp * ep) for bl, _ in stage.blocks]
    if stage.first:
        units.append(shape.embed_params / tp)
    if stage.last:
        units.append((shape.head_params or shape.embed_params) / tp)
    return max(units, default=0.0)
