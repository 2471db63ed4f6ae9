"""One pipeline rank's work for one micro-batch: its blocks, its transient memory, its time.

The planner (``planner._plan``) calls these for each kind of pipeline stage (the middle
ones repeat); ``Stage`` says what the stage is: its blocks, grouped as ``((block, how
many), ...)``, and whether it holds the embedding (first) and the head (last).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mtcore.plan import network, timing
from mtcore.plan.memory import (
    MTCORE_KEPT,
    Kept,
    backward_transient_bytes,
    head_saved_bytes,
    head_transient_bytes,
    layer_activation_bytes,
)
from mtcore.plan.shapes import Block, ModelShape


@dataclass(frozen=True)
class Stage:
    blocks: tuple[tuple[Block, int], ...]
    first: bool
    last: bool


def rank_blocks(shape: ModelShape, counts: list[int], pp: int, vpp: int, rank: int):
    """The blocks of every chunk of pipeline rank ``rank`` (virtual stage ``c * pp + rank``),
    as ``((block, how many), ...)``: a stack has few kinds of block, so each is costed once."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    groups: dict[Block, int] = {}
    for chunk in range(vpp):
        stage = chunk * pp + rank
        for block in shape.blocks[starts[stage] : starts[stage] + counts[stage]]:
            groups[block] = groups.get(block, 0) + 1
    if rank == pp - 1:  # the last stage's blocks after the pipeline's (MTP modules)
        for block in shape.last_blocks:
            groups[block] = groups.get(block, 0) + 1
    return tuple(groups.items())


def transient(shape, stage: Stage, b, spec, recompute, fused, e, heads=1) -> float:
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
            for bl, _ in stage.blocks
        ),
        default=0.0,
    )
    if stage.last:
        tokens = b * shape.head_seq / spec.cp
        trains = not shape.embed_frozen
        head = head_transient_bytes(tokens, shape.hidden, shape.vocab, spec.tp, sp, e, trains)
        saved = head_saved_bytes(tokens, shape.hidden, shape.vocab, spec.tp, sp, e)
        out = max(out, head + (heads * shape.head_passes - 1) * saved)
    if recompute == "full" and stage.blocks:
        out += max(
            layer_activation_bytes(bl, b, spec.tp, spec.cp, sp, "none", fused, e)
            for bl, _ in stage.blocks
        )
    return out


def recompute_flops(shape: ModelShape, recompute: str, kept: Kept = MTCORE_KEPT) -> float:
    """Extra FLOPs of one sequence that recompute spends (a forward of each block for
    full; the attention products for selective or the ``core_attn`` module; latent
    attention's up-projections for ``mla_up_proj``)."""
    blocks = shape.blocks + shape.last_blocks
    if recompute == "full":
        return sum(bl.forward_flops() for bl in blocks)
    flops = 0.0
    if recompute == "selective" or "core_attn" in kept.modules:
        flops += sum(bl.attention_product_flops() for bl in blocks)
    if "mla_up_proj" in kept.modules:
        for bl in blocks:
            if bl.latent is not None:
                flops += sum(2.0 * m * k * n for (m, k, n), _ in _up_projections(bl, bl.seq, 1))
    return flops


def weight_products(bl: Block, tokens: float, tp: int, ep: int):
    """``((M, K, N), calls)`` of one block's weight products, forward, on one tp rank for
    ``tokens`` tokens: their FLOPs sum to ``2 tokens active_weights / tp`` (latent
    attention's down-projections whole on each rank, its norms no product)."""
    return [(shape, calls) for shape, calls, _ in precision_products(bl, tokens, tp, ep)]


def precision_products(bl: Block, tokens: float, tp: int, ep: int, fp8_experts: bool = False):
    """``weight_products`` as ``((M, K, N), calls, fp8)``: ``fp8`` marks the products an
    FP8 recipe runs in FP8, mtcore's (docs/fp8.md): the blocks' column- and row-parallel
    linears (attention's, latent attention's up-projections and output, the dense MLP),
    not latent attention's replicated down-projections, the router, the routed or the
    shared experts; ``fp8_experts`` puts the experts in FP8 too (DeepSeek-V3's recipe,
    arXiv 2412.19437 sec. 3.3: every GEMM but the embedding, head, gating, norms and
    attention)."""
    h, q, kv = bl.hidden, bl.q_width, bl.kv_width
    gate = 2 if bl.gated else 1
    if bl.latent is not None:
        down, *linears = _latent_products(bl, tokens, tp)
        out = [(*down, False), *((*item, True) for item in linears)]
    else:
        out = [((tokens, h, (q + 2 * kv) / tp), 1, True), ((tokens, q / tp, h), 1, True)]
    if bl.cross_seq:  # a cross-attention over the encoder tokens, costed at the query count
        out += [((tokens, h, (q + 2 * kv) / tp), 1, True), ((tokens, q / tp, h), 1, True)]
    for inner, fp8 in ((bl.ffn, True), (bl.shared_ffn, fp8_experts)):
        if inner:
            out += [((tokens, h, gate * inner / tp), 1, fp8), ((tokens, inner / tp, h), 1, fp8)]
    if bl.experts:
        out.append(((tokens, h, bl.experts / tp), 1, False))  # the router
        local = bl.experts / ep
        rows = tokens * bl.top_k / local  # balanced: every expert gets top_k / E of the rows
        out += [
            ((rows, h, gate * bl.expert_ffn / tp), local, fp8_experts),
            ((rows, bl.expert_ffn / tp, h), local, fp8_experts),
        ]
    return out


def _weight_seconds(products: timing.Products, bl: Block, rows: float, tp: int, ep: int) -> float:
    """One forward pass of ``bl``'s weight products, each in its precision."""
    items = precision_products(bl, rows, tp, ep, products.fp8_experts)
    return sum(products.seconds(shape, calls, fp8) for shape, calls, fp8 in items)


def _quantize_seconds(products: timing.Products, bl: Block, rows: float, spec, hw, e) -> float:
    """The FP8 products' quantization for one micro-batch (``timing.fp8_quantize_bytes``):
    forward the input and the weight, backward the output's gradient."""
    if products.block_dtype != "fp8":
        return 0.0
    items = precision_products(bl, rows, spec.tp, spec.ep, products.fp8_experts)
    elements = sum(calls * (m * k + k * n + m * n) for (m, k, n), calls, fp8 in items if fp8)
    return timing.memory_bound(hw, elements * timing.fp8_quantize_bytes(e, products.fp8_recipe))


def _up_projections(bl: Block, tokens: float, tp: int):
    """Latent attention's query and key/value up-projections (what ``mla_up_proj``
    recomputes)."""
    return _latent_products(bl, tokens, tp)[1:3]


def _latent_products(bl: Block, tokens: float, tp: int):
    """Latent attention's products: the down-projections whole on every tp rank, the
    up-projections and output split over heads."""
    lat, h, heads = bl.latent, bl.hidden, bl.heads / tp
    return [
        ((tokens, h, lat.q_rank + lat.kv_rank + lat.rope), 1),
        ((tokens, lat.q_rank or h, heads * lat.qk_dim), 1),
        ((tokens, lat.kv_rank, heads * (lat.nope + lat.v_dim)), 1),
        ((tokens, heads * lat.v_dim, h), 1),
    ]


def score_products(bl: Block, b: int, tp: int, cp: int):
    """``((M, K, N), calls)`` of the attention's ``QK^T`` and ``AV`` per head, forward:
    their FLOPs sum to ``attention_product_flops() b / (tp cp)``."""
    heads = b * bl.heads / tp
    queries, d = bl.seq / bl.cp_share(cp), bl.head_dim
    out = [((queries, d, bl.kv_seq), heads), ((queries, bl.kv_seq, d), heads)]
    if bl.cross_seq:
        out += [((queries, d, bl.cross_seq), heads), ((queries, bl.cross_seq, d), heads)]
    return out


def _forward_seconds(products: timing.Products, items, block: bool) -> float:
    return sum(products.seconds(shape, calls, block) for shape, calls in items)


def microbatch_time(
    shape,
    stage: Stage,
    b,
    spec,
    hw,
    recompute,
    fused,
    e,
    products,
    kept: Kept = MTCORE_KEPT,
    order: str = network.RANK_ORDERS[0],
    node_limit: int | None = None,
) -> dict:
    """Seconds of one micro-batch through ``stage`` by cause: products (forward and the
    backward's passes, ``Block.passes``), recompute, memory-bound work, and tp/cp/ep/pp
    communication as mtcore runs it (exposed); ``order``: the rank order
    (``network.RANK_ORDERS``), which places the pipeline's sends; ``node_limit``: the
    most nodes a token's experts lie on (``network.node_limited_all_to_all``)."""
    tp, cp, ep = spec.tp, spec.cp, spec.ep
    tokens = b * shape.seq_len / cp  # per rank; T5's decoder uses its own length below
    fwd = back = live_w = live_s = kernel_s = quantize = 0.0
    for bl, n in stage.blocks:
        rows = b * bl.seq / bl.cp_share(cp)
        weights = _weight_seconds(products, bl, rows, tp, ep)
        quantize += n * _quantize_seconds(products, bl, rows, spec, hw, e)
        scores = _forward_seconds(products, score_products(bl, b, tp, cp), False)
        fwd += n * (weights + scores)
        # the backward's passes after the forward (Block.passes - 1: 2 with weight
        # gradients, 1 for frozen weights passing the gradient on, 0 under no_grad; the
        # score products have no weights, so 2 whenever there is a backward)
        back += n * ((bl.passes - 1) * weights + (bl.product_passes - 1) * scores)
        if bl.keeps_activations:
            live_w, live_s = live_w + n * weights, live_s + n * scores
            kernel_s += 0.0 if bl.biased_attention else n * scores
    head = _head_seconds(shape, stage, b, spec, products)
    head *= 2 if shape.embed_frozen else 3  # frozen: no weight gradient
    head *= shape.head_passes  # MTP modules run the head again
    # a fused attention's backward recomputes the scores (Q K^T) per block (not where
    # a bias outside the kernel keeps them: Block.biased_attention)
    compute = fwd + back + head + (0.5 * kernel_s if fused else 0.0)
    if stage.first and shape.first_stage_flops:  # outside the blocks, whole on every tp rank
        flops = b * shape.first_stage_flops
        compute += products.flops_seconds(flops, flops / 3)
    if stage.last and shape.last_stage_params:  # MTP's W_k, whole on every tp rank
        flops = 6.0 * b * shape.seq_len / cp * shape.last_stage_params
        compute += products.flops_seconds(flops, flops / 3)
    redo = {"full": live_w + live_s, "selective": live_s}.get(recompute, 0.0)
    if recompute == "none" and "core_attn" in kept.modules:
        redo += live_s
    if recompute != "full" and kept.modules:
        redo += _module_recompute_seconds(stage, b, spec, hw, fused, e, products, kept)
    kept_bytes = sum(
        n * layer_activation_bytes(bl, b, tp, cp, spec.sequence_parallel, "none", fused, e)
        for bl, n in stage.blocks
    )
    passes = timing.ELEMENTWISE_PASSES + (2 if recompute == "full" else 0)
    loss_traffic = 0.0
    if stage.last:  # the loss over the vocabulary shard, in fp32 (timing.cross_entropy_bytes)
        loss_traffic = b * shape.head_seq / cp * shape.vocab / tp * timing.cross_entropy_bytes(e)
        loss_traffic *= shape.head_passes
    memory_bound = timing.memory_bound(hw, passes * kept_bytes + loss_traffic) + quantize
    return {
        "compute": compute,
        "recompute": redo,
        "memory_bound": memory_bound,
        **_communication(shape, stage, b, spec, hw, recompute, e, tokens, kept, order, node_limit),
        # the software's fixed cost: a forward and a backward through each chunk
        "overhead": 2 * spec.vpp * hw.microbatch_overhead_us * 1e-6,
    }


def _module_recompute_seconds(stage: Stage, b, spec, hw, fused, e, products, kept: Kept) -> float:
    """What rebuilding ``kept.modules`` costs one micro-batch's backward: the MLA
    up-projections' products again (``mla_up_proj``), and for the norms and the experts'
    activation (``layernorm``, ``moe_act``) memory traffic of twice the bytes they rebuild
    (reading what they are rebuilt from, writing them)."""
    tp, cp, sp = spec.tp, spec.cp, spec.sequence_parallel
    elementwise = kept.modules & {"layernorm", "moe_act"}
    keeping = replace(kept, modules=kept.modules - elementwise)
    seconds = rebuilt = 0.0
    for bl, n in stage.blocks:
        if not bl.keeps_activations:
            continue
        if "mla_up_proj" in kept.modules and bl.latent is not None:
            rows = b * bl.seq / bl.cp_share(cp)
            seconds += n * _forward_seconds(products, _up_projections(bl, rows, tp), True)
        if elementwise:
            whole = layer_activation_bytes(bl, b, tp, cp, sp, "none", fused, e, keeping)
            rebuilt += n * (
                whole - layer_activation_bytes(bl, b, tp, cp, sp, "none", fused, e, kept)
            )
    return seconds + timing.memory_bound(hw, 2 * rebuilt)


def weight_grad_seconds(shape, stage: Stage, b, spec, products) -> float:
    """The part of a micro-batch's compute through ``stage`` that a zero-bubble
    schedule's W pass runs: one weight-gradient product per trained weight product."""
    seconds = 0.0
    for bl, n in stage.blocks:
        if bl.passes == 3:  # weights with gradients (Block.passes)
            rows = b * bl.seq / bl.cp_share(spec.cp)
            seconds += n * _weight_seconds(products, bl, rows, spec.tp, spec.ep)
    if not shape.embed_frozen:
        seconds += _head_seconds(shape, stage, b, spec, products) * shape.head_passes
    return seconds


def _head_seconds(shape, stage: Stage, b, spec, products) -> float:
    """One pass of the output head's products (forward), on the last stage."""
    if not stage.last:
        return 0.0
    rows = b * shape.head_seq / spec.cp
    head = products.seconds((rows, shape.hidden, shape.vocab / spec.tp))
    if shape.head_dense:
        head += products.seconds((rows, shape.hidden, shape.head_dense / spec.tp))
    return head


def _communication(
    shape,
    stage: Stage,
    b,
    spec,
    hw,
    recompute,
    e,
    tokens,
    kept=MTCORE_KEPT,
    order=None,
    node_limit=None,
) -> dict:
    order = order or network.RANK_ORDERS[0]
    tp, cp, ep = spec.tp, spec.cp, spec.ep
    tp_comm = cp_comm = ep_comm = 0.0
    calls = 4 + (2 if recompute == "full" else 0)
    for bl, count in stage.blocks:
        activation = e * b * bl.seq / bl.cp_share(cp) * bl.hidden
        n = calls + (2 if bl.cross_seq else 0) if bl.keeps_activations else 2  # forward only
        tp_comm += count * n * network.all_reduce(hw, activation, tp, 1)
        if bl.cp_share(cp) > 1:
            kv = e * b * bl.seq / cp * 2 * bl.kv_width / tp
            sends = 3 + (1 if recompute == "full" else 0)  # fwd, 2x bwd (dK, dV), recompute
            if spec.cp_method == "ring":
                cp_comm += count * sends * (cp - 1) * network.p2p(hw, kv, cp, tp)
            elif spec.cp_method == "allgather":
                # T5's cross-attention gathers the encoder's K/V too (the only method it takes)
                kv += e * b * bl.cross_seq / cp * 2 * bl.kv_width / tp
                cp_comm += count * sends * network.all_gather(hw, kv * cp, cp, tp)
            else:  # a2a: q, k, v in and the output back, forward and backward
                qkvo = e * b * bl.seq / cp * (2 * bl.q_width + 2 * bl.kv_width) / tp
                cp_comm += count * sends * network.all_to_all(hw, qkvo, cp, tp)
        if bl.experts and ep > 1:
            ep_comm += count * _expert_all_to_alls(
                hw, bl, b, cp, ep, tp, e, calls, kept, node_limit
            )
    pp_comm = 0.0
    if spec.pp > 1:
        boundary = e * tokens * shape.hidden / (tp if spec.sequence_parallel else 1)
        sends = 2 * spec.vpp  # every chunk: its activation forward, its gradient back
        send = network.p2p(hw, boundary, spec.pp, network.pp_stride(spec, order))
        pp_comm = sends * (send + hw.p2p_overhead_us * 1e-6)
    return {"tp_comm": tp_comm, "cp_comm": cp_comm, "ep_comm": ep_comm, "pp_comm": pp_comm}


def _expert_all_to_alls(
    hw, bl: Block, b, cp, ep, tp, e, calls: int, kept: Kept, node_limit: int | None = None
) -> float:
    """One micro-batch's expert all-to-alls through ``bl``: the dispatch and the combine
    forward, their gradients backward (and the forward's again under full recompute).
    The forward dispatch and the backward's gradient dispatch (the combine's backward)
    move ``kept.dispatch_bytes`` an element (fp8 with its scales under an fp8 dispatch,
    DeepSeek-V3 sec. 3.3.2), the combines ``e``."""
    tokens = b * bl.seq / cp

    def one(element_bytes: float) -> float:
        if node_limit is None:
            return network.all_to_all(hw, element_bytes * tokens * bl.top_k * bl.hidden, ep, tp)
        return network.node_limited_all_to_all(
            hw, element_bytes * bl.hidden, tokens, bl.top_k, node_limit, ep, tp
        )

    if kept.dispatch_bytes is None:
        return calls * one(e)
    dispatches = calls // 2  # fwd dispatch, bwd gradient dispatch (and a recomputed one)
    return dispatches * one(kept.dispatch_bytes) + (calls - dispatches) * one(e)


def replicated_grad_seconds(shape, stage: Stage, spec, hw, grad_bytes: int) -> float:
    """Once a step under sequence parallel: the tp all-reduce of the gradients of the
    weights every tp rank holds whole but runs on its sequence shard (latent attention's
    down-projections, MTP's ``W_k``; mtcore's ``allreduce_sequence_parallel_grads``)."""
    if not spec.sequence_parallel or spec.tp == 1:
        return 0.0
    weights = sum(n * bl.replicated_weights() for bl, n in stage.blocks)
    weights += shape.last_stage_params if stage.last else 0
    if not weights:
        return 0.0
    return network.all_reduce(hw, grad_bytes * weights, spec.tp, 1)
