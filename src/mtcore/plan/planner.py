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

    @property
    def exposed_comm(self) -> float:
        """Communication the step waits for: tp, cp, ep, pp, dp and the tied embedding's."""
        comm = self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
        return comm + self.dp_exposed + self.tied_comm

    @property
    def total(self) -> float:
        busy = self.compute + self.recompute + self.memory_bound
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
    (``Options.cross_node`` allows it: the group is then priced on the network)."""
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


def _plan(config, spec, m, shape: ModelShape, gpus, hardware, options) -> Plan:
    p = config.parallel
    tp, cp, pp, vpp, ep, dp = spec.tp, spec.cp, spec.pp, spec.vpp, spec.ep, spec.dp
    check_placement(spec, hardware, options)
    b = config.training.micro_batch_size
    dtype = config.precision.dtype
    e = dtype_bytes(dtype)
    fused = options.flash(hardware)
    zero = options.zero_stage(config)
    recompute = shape.recompute
    counts = shape.counts(pp, vpp, spec.first_stage_layers, spec.last_stage_layers)
    notes: list[str] = []
    peak = hardware.peak_flops(dtype)
    block_dtype = dtype
    if config.precision.fp8 is not None:
        if "fp8" in hardware.peak_tflops:
            notes.append("fp8: the blocks' products run at the fp8 peak")
            block_dtype = "fp8"
        else:
            notes.append(f"fp8: {hardware.name} gives no fp8 peak; products at the {dtype} peak")
    products = timing.Products(hardware, dtype, block_dtype)
    notes.append(products.note())
    if zero >= 2:
        notes.append(f"ZeRO-{zero}: a planner assumption; mtcore trains with ZeRO-0 or 1")
    grad_bytes = options.grad_bytes
    per_byte = state_bytes_per_param(dtype, zero, dp * cp, grad_bytes)
    lora = config.finetune.lora
    if lora is not None:
        notes.append(f"lora: rank {lora.rank} on {', '.join(lora.targets)}; the base is frozen")
        notes += sorted({adapter_params(bl, lora, tp)[1] for bl in shape.blocks} - {None})
    per_byte_expert = state_bytes_per_param(dtype, zero, max(1, dp * cp // ep), grad_bytes)

    ranks: list[RankMemory] = []
    stage_times = []
    weight_grads = []  # per rank: the W share of its compute (zero-bubble schedules)
    largest_units = []
    replicated_grads = []  # seconds per step, per rank
    seen: dict = {}
    for rank in range(pp):
        stage = Stage(rank_blocks(shape, counts, pp, vpp, rank), rank == 0, rank == pp - 1)
        holds = stage_params(shape, stage.blocks, tp, ep, pp, stage.first, stage.last)
        dense, experts, frozen = holds.trained, holds.experts, holds.frozen
        if lora is not None:  # the base frozen: the adapters alone train
            frozen, experts = frozen + dense + experts, 0.0
            dense = sum(
                n * adapter_params(bl, lora, tp)[0] for bl, n in stage.blocks if not bl.frozen
            )
        held = in_flight(p.schedule, pp, vpp, rank, m)
        acts_per_mb = sum(
            n * layer_activation_bytes(bl, b, tp, cp, spec.sequence_parallel, recompute, fused, e)
            for bl, n in stage.blocks
            if bl.keeps_activations  # a block run under no_grad keeps nothing
        )
        heads = heads_in_flight(p.schedule, pp, vpp, m)
        extra = transient(shape, stage, b, spec, recompute, fused, e, heads)
        unit = _largest_unit(shape, stage, tp, ep)
        largest_units.append(unit)
        replicated_grads.append(replicated_grad_seconds(shape, stage, spec, hardware, grad_bytes))
        # ZeRO-2/3: the bucket being reduced; ZeRO-3: a gathered unit and the next one
        if zero >= 2 and dp * cp > 1:
            extra += grad_bytes * min(p.bucket_size, dense + experts)
            extra += 2 * e * unit if zero == 3 else 0.0
        ranks.append(
            RankMemory(
                stage=rank,
                params=round(dense),
                expert_params=round(experts),
                weights=(dense + frozen) * per_byte["params"] + experts * per_byte_expert["params"],
                grads=dense * per_byte["grads"] + experts * per_byte_expert["grads"],
                master=dense * per_byte["master"] + experts * per_byte_expert["master"],
                optimizer=dense * per_byte["optimizer"] + experts * per_byte_expert["optimizer"],
                activations=acts_per_mb * held,
                transient=extra,
                in_flight=held,
            )
        )
        if stage not in seen:  # middle stages repeat: time each kind of stage once
            seen[stage] = microbatch_time(
                shape, stage, b, spec, hardware, recompute, fused, e, products
            )
        stage_times.append(dict(seen[stage]))
        weight_grads.append(weight_grad_seconds(shape, stage, b, spec, products))

    for times in stage_times:
        busy = times["compute"] + times["recompute"]
        for axis in options.overlapped:
            key = f"{axis}_comm"
            times[key] = max(0.0, times[key] - busy)
            busy = max(0.0, busy - times[key])
    per_stage = [sum(times.values()) for times in stage_times]
    slow = max(range(pp), key=lambda r: per_stage[r])
    t = stage_times[slow]
    bubble = pipeline_bubble(p.schedule, per_stage, weight_grads, slow, vpp)
    dp_traffic = data_parallel.traffic(
        ranks[slow].params,
        ranks[slow].expert_params,
        largest_units[slow],
        spec,
        hardware,
        e,
        grad_bytes,
        p.bucket_size,
        zero,
    )
    backward_one, forward_one = t["compute"] * 2 / 3, t["compute"] / 3
    dp_exposed = data_parallel.exposed(
        dp_traffic, zero, options.dp_overlap, pp, m, forward_one, backward_one
    )
    opt_elems = ranks[slow].params / (dp * cp if zero >= 1 else 1)
    opt_elems += ranks[slow].expert_params / (max(1, dp * cp // ep) if zero >= 1 else 1)
    optimizer = timing.memory_bound(hardware, opt_elems * (28 + e))
    tied = 0.0
    if shape.tied and pp > 1:  # the word embedding's gradient, summed over its two copies
        embedding = grad_bytes * shape.vocab * shape.hidden / tp
        tied = network.all_reduce(hardware, embedding, 2, (pp - 1) * tp * cp * dp)
    time = StepTime(
        compute=m * t["compute"],
        recompute=m * t["recompute"],
        memory_bound=m * t["memory_bound"],
        tp_comm=m * t["tp_comm"] + replicated_grads[slow],
        cp_comm=m * t["cp_comm"],
        ep_comm=m * t["ep_comm"],
        pp_comm=m * t["pp_comm"],
        bubble=bubble,
        dp_comm=dp_traffic.total(m, zero),
        dp_exposed=dp_exposed,
        optimizer=optimizer,
        tied_comm=tied,
    )
    global_batch = config.training.global_batch_size
    model_flops = config.model.flops_per_step(global_batch)
    extra_flops = recompute_flops(shape, recompute) * global_batch
    if any(bl.experts for bl in shape.blocks):
        notes.append("MoE: routing assumed balanced (every expert gets top_k/E of the tokens)")
    if any(bl.latent for bl in shape.blocks):
        notes.append(_latent_cache_note(shape, e))
    return Plan(
        layout=layout_of(config) | {"dp": dp, "zero": zero},
        hardware=hardware.name,
        gpus=gpus,
        family=shape.family,
        params=shape.total_params,
        microbatches=m,
        ranks=ranks,
        time=time,
        memory_limit=hardware.memory_bytes,
        tokens_per_step=global_batch * shape.seq_len,
        model_flops=model_flops,
        hardware_flops=model_flops + extra_flops,
        peak_flops=peak,
        notes=notes,
        assumed=options.assumed(config, hardware) | _stage_layers(counts, pp, vpp),
        stage_seconds=stage_times,
        weight_seconds=weight_grads,
    )


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
