"""``plan(config, gpus, hardware)``: per-rank memory and predicted step time of one layout.

The layout is checked first by ``TrainConfig.check`` (what ``mtcore train`` runs),
so a layout the trainer would reject raises the trainer's own error. Then, per
pipeline rank: the parameters it holds, the activations of the micro-batches its
schedule keeps in flight, and the time of one micro-batch through its chunks;
the slowest rank sets the pipeline's pace (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtcore.plan import timing
from mtcore.plan.hardware import Hardware
from mtcore.plan.memory import (
    backward_transient_bytes,
    dtype_bytes,
    head_saved_bytes,
    head_transient_bytes,
    heads_in_flight,
    in_flight,
    layer_activation_bytes,
    state_bytes_per_param,
)
from mtcore.plan.shapes import Block, ModelShape, model_shape, stage_params

DP_OVERLAP = ("mtcore", "none", "full")
"""How the data-parallel gradient reduction meets backward: ``mtcore`` as the trainer
does it (overlapped with the last micro-batch's backward at pp=1, after the pipeline
at pp>1), ``none`` (always after backward) or ``full`` (always overlapped)."""


@dataclass(frozen=True)
class Options:
    """Planner settings that are facts about the software measured, not the layout.

    dp_overlap: see ``DP_OVERLAP``. fused_attention: None takes the hardware file's.
    grad_bytes: bytes per gradient element the data-parallel reduction moves (mtcore
    reduces its fp32 gradient buffers: 4; Megatron in 2021 reduced fp16 ones: 2;
    Megatron-Core in bf16 reduces fp32 ones, since its arguments.py turns
    ``accumulate_allreduce_grads_in_fp32`` on for bf16: 4).
    """

    dp_overlap: str = "mtcore"
    fused_attention: bool | None = None
    grad_bytes: int = 4
    overlapped: tuple[str, ...] = ()
    """Axes ("tp", "cp", "ep", "pp") whose communication the software hides behind
    compute (Megatron-Core's ``--tp-comm-overlap``, its overlapped p2p); mtcore: none.
    Only what exceeds the micro-batch's compute stays exposed."""


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

    @property
    def total(self) -> float:
        busy = self.compute + self.recompute + self.memory_bound
        comm = self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
        return busy + comm + self.bubble + self.dp_exposed + self.optimizer


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
            "notes": self.notes,
        }


def layout_of(config) -> dict:
    p = config.parallel
    keys = ("tp", "cp", "pp", "vpp", "ep", "sequence_parallel", "zero1", "schedule", "cp_method")
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


def _plan(config, spec, m, shape: ModelShape, gpus, hardware, options) -> Plan:
    p = config.parallel
    tp, cp, pp, vpp, ep, dp = spec.tp, spec.cp, spec.pp, spec.vpp, spec.ep, spec.dp
    b = config.training.micro_batch_size
    dtype = config.precision.dtype
    e = dtype_bytes(dtype)
    fused = hardware.fused_attention if options.fused_attention is None else options.fused_attention
    recompute = shape.recompute
    counts = shape.counts(pp, vpp)
    notes: list[str] = []
    peak = hardware.peak_flops(dtype)
    if config.precision.fp8 is not None:
        if "fp8" in hardware.peak_tflops:
            notes.append("fp8: the blocks' products run at the fp8 peak")
        else:
            notes.append(f"fp8: {hardware.name} gives no fp8 peak; products at the {dtype} peak")
    block_peak = (
        hardware.peak_flops("fp8")
        if config.precision.fp8 and "fp8" in hardware.peak_tflops
        else peak
    )
    per_byte = state_bytes_per_param(dtype, p.zero1, dp * cp)
    per_byte_expert = state_bytes_per_param(dtype, p.zero1, max(1, dp * cp // ep))

    ranks: list[RankMemory] = []
    stage_times = []
    seen: dict = {}
    for rank in range(pp):
        blocks = _rank_blocks(shape, counts, pp, vpp, rank)
        first, last = rank == 0, rank == pp - 1
        holds = stage_params(shape, blocks, tp, ep, pp, first, last)  # frozen: weights only
        dense, experts, frozen = holds.trained, holds.experts, holds.frozen
        held = in_flight(p.schedule, pp, vpp, rank, m)
        acts_per_mb = sum(
            n * layer_activation_bytes(bl, b, tp, cp, spec.sequence_parallel, recompute, fused, e)
            for bl, n in blocks
            if bl.keeps_activations  # a block run under no_grad keeps nothing
        )
        heads = heads_in_flight(p.schedule, pp, vpp, m)
        transient = _transient(shape, blocks, b, spec, recompute, fused, e, first, last, heads)
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
                transient=transient,
                in_flight=held,
            )
        )
        key = (blocks, first, last)
        if key not in seen:  # middle stages repeat: time each kind of stage once
            seen[key] = _microbatch_time(
                shape, blocks, b, spec, hardware, recompute, fused, e, first, last, peak, block_peak
            )
        stage_times.append(dict(seen[key]))

    for times in stage_times:
        busy = times["compute"] + times["recompute"]
        for axis in options.overlapped:
            key = f"{axis}_comm"
            times[key] = max(0.0, times[key] - busy)
            busy = max(0.0, busy - times[key])
    slow = max(range(pp), key=lambda r: sum(stage_times[r].values()))
    t = stage_times[slow]
    per_mb = sum(t.values())
    bubble = (pp - 1) / vpp * per_mb if pp > 1 else 0.0
    reduce, gather, last_bucket = _dp_time(ranks[slow], spec, p, hardware, e, options.grad_bytes)
    dp_comm = reduce + gather
    backward_one, forward_one = t["compute"] * 2 / 3, t["compute"] / 3
    overlap = options.dp_overlap
    if overlap == "mtcore":  # reduce from backward at pp=1; the ZeRO-1 gather after the step
        dp_exposed = (max(reduce - backward_one, last_bucket) if pp == 1 else reduce) + gather
    elif overlap == "full":  # reduce behind the last backward, gather behind the first forward
        dp_exposed = max(reduce - backward_one, last_bucket) + max(0.0, gather - forward_one)
    else:
        dp_exposed = dp_comm
    opt_elems = ranks[slow].params / (dp * cp if p.zero1 else 1)
    opt_elems += ranks[slow].expert_params / (max(1, dp * cp // ep) if p.zero1 else 1)
    optimizer = timing.memory_bound(hardware, opt_elems * (28 + e))
    time = StepTime(
        compute=m * t["compute"],
        recompute=m * t["recompute"],
        memory_bound=m * t["memory_bound"],
        tp_comm=m * t["tp_comm"],
        cp_comm=m * t["cp_comm"],
        ep_comm=m * t["ep_comm"],
        pp_comm=m * t["pp_comm"],
        bubble=bubble,
        dp_comm=dp_comm,
        dp_exposed=dp_exposed,
        optimizer=optimizer,
    )
    global_batch = config.training.global_batch_size
    model_flops = config.model.flops_per_step(global_batch)
    extra = _recompute_flops(shape, recompute) * global_batch
    if any(bl.experts for bl in shape.blocks):
        notes.append("MoE: routing assumed balanced (every expert gets top_k/E of the tokens)")
    return Plan(
        layout=layout_of(config) | {"dp": dp},
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
        hardware_flops=model_flops + extra,
        peak_flops=peak,
        notes=notes,
    )


def _rank_blocks(shape: ModelShape, counts: list[int], pp: int, vpp: int, rank: int):
    """The blocks of every chunk of pipeline rank ``rank`` (virtual stage ``c * pp + rank``),
    as ``((block, how many), ...)``: a stack has few kinds of block, so each is costed once."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    groups: dict[Block, int] = {}
    for chunk in range(vpp):
        stage = chunk * pp + rank
        for block in shape.blocks[starts[stage] : starts[stage] + counts[stage]]:
            groups[block] = groups.get(block, 0) + 1
    return tuple(groups.items())


def _transient(shape, blocks, b, spec, recompute, fused, e, first, last, heads=1) -> float:
    """Memory a stage's peak holds beyond its layers' kept activations, for one micro-batch:
    what the backward allocates as it starts (``memory.backward_transient_bytes``: the
    gradient received, the first weight gradient; the last stage's loss and head,
    ``memory.head_transient_bytes``, whichever is larger) and, with full recompute, one
    layer's activations rebuilt for its backward. The first stage's embedding output
    is its first layer's input, counted with that layer's activations. A schedule that
    runs ``heads`` last-stage forwards before their backwards (``memory.heads_in_flight``)
    keeps each other one's ``memory.head_saved_bytes`` too."""
    sp = spec.sequence_parallel
    out = max(
        (
            backward_transient_bytes(bl, b, spec.tp, spec.ep, spec.cp, sp, e, True)
            for bl, _ in blocks
        ),
        default=0.0,
    )
    if last:
        tokens = b * shape.head_seq / spec.cp
        trains = not shape.embed_frozen
        head = head_transient_bytes(tokens, shape.hidden, shape.vocab, spec.tp, sp, e, trains)
        saved = head_saved_bytes(tokens, shape.hidden, shape.vocab, spec.tp, sp, e)
        out = max(out, head + (heads - 1) * saved)
    if recompute == "full" and blocks:
        out += max(
            layer_activation_bytes(bl, b, spec.tp, spec.cp, sp, "none", fused, e)
            for bl, _ in blocks
        )
    return out


def _recompute_flops(shape: ModelShape, recompute: str) -> float:
    """Extra FLOPs of one sequence that recompute spends (a forward of each block for
    full; the attention products for selective)."""
    if recompute == "full":
        return sum(bl.forward_flops() for bl in shape.blocks)
    if recompute == "selective":
        return sum(bl.attention_product_flops() for bl in shape.blocks)
    return 0.0


def _microbatch_time(
    shape, blocks, b, spec, hw, recompute, fused, e, first, last, peak, block_peak
):
    tp, cp, ep = spec.tp, spec.cp, spec.ep
    rate, block_rate = timing.gemm_flops(hw, peak), timing.gemm_flops(hw, block_peak)
    weights = sum(n * 2.0 * bl.seq * bl.active_weights() for bl, n in blocks) * b / (tp * cp)
    products = sum(n * bl.attention_product_flops() for bl, n in blocks) * b / (tp * cp)
    fwd = weights / block_rate + products / rate
    # Backward: each block's passes after the forward (Block.passes - 1: 2 with weight
    # gradients, 1 for frozen weights passing the gradient on, 0 under no_grad; the
    # score products have no weights, so 2 whenever there is a backward).
    live = tuple((bl, n) for bl, n in blocks if bl.keeps_activations)
    back_weights = sum(n * (bl.passes - 1) * 2.0 * bl.seq * bl.active_weights() for bl, n in blocks)
    back_products = sum(
        n * (bl.product_passes - 1) * bl.attention_product_flops() for bl, n in blocks
    )
    back = (back_weights / block_rate + back_products / rate) * b / (tp * cp)
    live_weights = sum(n * 2.0 * bl.seq * bl.active_weights() for bl, n in live) * b / (tp * cp)
    live_products = sum(n * bl.attention_product_flops() for bl, n in live) * b / (tp * cp)
    head = 0.0
    if last:
        head = 2.0 * b * shape.head_seq / cp * (shape.vocab + shape.head_dense) * shape.hidden / tp
        head = (2 if shape.embed_frozen else 3) * head / rate  # frozen: no weight gradient
    # a fused attention's backward recomputes the scores (Q K^T) per block
    compute_extra = 0.5 * live_products / rate if fused else 0.0
    compute = fwd + back + head + compute_extra
    if first:  # the first stage's products outside the blocks, whole on every tp rank
        compute += b * shape.first_stage_flops / rate
    redo = live_weights / block_rate + live_products / rate if recompute == "full" else 0.0
    if recompute == "selective":
        redo = live_products / rate
    kept = sum(
        n * layer_activation_bytes(bl, b, tp, cp, spec.sequence_parallel, "none", fused, e)
        for bl, n in blocks
    )
    passes = timing.ELEMENTWISE_PASSES + (2 if recompute == "full" else 0)
    loss_traffic = 0.0
    if last:  # the loss over the vocabulary shard, in fp32 (timing.cross_entropy_bytes)
        loss_traffic = b * shape.head_seq / cp * shape.vocab / tp * timing.cross_entropy_bytes(e)
    memory_bound = timing.memory_bound(hw, passes * kept + loss_traffic)

    tokens = b * shape.seq_len / cp  # per rank; T5's decoder uses its own length below
    tp_comm = cp_comm = ep_comm = 0.0
    calls = 4 + (2 if recompute == "full" else 0)
    for bl, count in blocks:
        activation = e * b * bl.seq / cp * bl.hidden
        n = calls + (2 if bl.cross_seq else 0) if bl.keeps_activations else 2  # forward only
        tp_comm += count * n * timing.all_reduce(hw, activation, tp, 1)
        if cp > 1:
            kv = e * b * bl.seq / cp * 2 * bl.kv_width / tp
            sends = 3 + (1 if recompute == "full" else 0)  # fwd, 2x bwd (dK, dV), recompute
            if spec.cp_method == "ring":
                cp_comm += count * sends * (cp - 1) * timing.p2p(hw, kv, tp)
            elif spec.cp_method == "allgather":
                cp_comm += count * sends * timing.all_gather(hw, kv * cp, cp, tp)
            else:  # a2a: q, k, v in and the output back, forward and backward
                qkvo = e * b * bl.seq / cp * (2 * bl.q_width + 2 * bl.kv_width) / tp
                cp_comm += count * sends * timing.all_gather(hw, qkvo, cp, tp)
        if bl.experts and ep > 1:
            rows = e * b * bl.seq / cp * bl.top_k * bl.hidden
            ep_comm += count * calls * timing.all_gather(hw, rows, ep, tp)
    pp_comm = 0.0
    if spec.pp > 1:
        boundary = e * tokens * shape.hidden / (tp if spec.sequence_parallel else 1)
        sends = 2 * spec.vpp  # every chunk: its activation forward, its gradient back
        pp_comm = sends * timing.p2p(hw, boundary, tp * cp * spec.dp)
    return {
        "compute": compute,
        "recompute": redo,
        "memory_bound": memory_bound,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "ep_comm": ep_comm,
        "pp_comm": pp_comm,
    }


def _dp_time(rank: RankMemory, spec, parallel, hw, e, grad_bytes) -> tuple[float, float, float]:
    """Seconds of one step's gradient reduction, of the ZeRO-1 parameter all-gather
    (0 without ZeRO-1), and of the last gradient bucket (which nothing can hide)."""
    d = spec.dp * spec.cp
    span = spec.tp  # dp x cp peers sit tp ranks apart
    edp = max(1, d // spec.ep)
    grads = grad_bytes * rank.params
    expert_grads = grad_bytes * rank.expert_params
    gather = 0.0
    if parallel.zero1:  # reduce-scatter the gradients, all-gather the updated params
        reduce = timing.all_gather(hw, grads, d, span) + timing.all_gather(
            hw, expert_grads, edp, span
        )
        gather = timing.all_gather(hw, e * rank.params, d, span)
        gather += timing.all_gather(hw, e * rank.expert_params, edp, span)
    else:
        reduce = timing.all_reduce(hw, grads, d, span) + timing.all_reduce(
            hw, expert_grads, edp, span
        )
    bucket = min(grad_bytes * parallel.bucket_size, grads)
    last = timing.all_reduce(hw, bucket, d, span) if d > 1 else 0.0
    return reduce, gather, last
