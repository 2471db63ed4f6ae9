"""Per-rank memory: weights, gradients, master weights and optimizer state, activations.

Weights and optimizer state follow mtcore's mixed precision: parameters in the
compute dtype, fp32 gradient buffers, fp32 master weights (none when the dtype is
fp32 itself) and fp32 AdamW moments; ZeRO-1 shards master weights and moments over
the data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the parameters too.
In bf16 that is 18 bytes per parameter, 6 + 12/d under ZeRO-1 (Megatron-Core's
distributed optimizer), 2 + 16/d under ZeRO-2 and 18/d under ZeRO-3 (Rajbhandari et
al. 2020).

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198), generalised to
grouped-query attention, gated MLPs, mixture of experts and context parallelism;
for a GPT-3 block (4h GELU MLP, as many key/value heads as heads, dropout) they are
exactly the paper's per-layer counts:

* no recompute, tp t:        s b h (10 + 24/t + 5 a s / (h t))
* with sequence parallel:    s b h (34/t + 5 a s / (h t))
* selective recompute:       the 5 a s / (h t) term (attention scores) dropped
* full recompute:            2 s b h per layer (its input; / t with sequence parallel)

A fused (flash) attention keeps no score matrix, only a log-sum-exp per query. A
gated MLP keeps four intermediates of its width (the two branches, the activation's
output that the product's backward reads, and the product), a GELU one two.

Beyond the layers' activations a stage's peak holds, for one micro-batch, what its
backward allocates before the first weight gradient is added to the fp32 buffer
(``backward_transient_bytes``): measured with ``mtcore sweep`` on the host, where a
rank's tensor peak falls at the start of a backward (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtcore.parallel.pipeline.table import schedule_entry
from mtcore.plan.shapes import Block

MASK_BYTES = 1  # a dropout mask element
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act")
"""Sub-modules a selective recompute may rebuild in backward instead of keeping their
outputs, by Megatron-Core's ``--recompute-modules`` names: ``core_attn`` the attention
scores (mtcore's ``selective``), ``layernorm`` the norms' outputs (their inputs are
kept), ``mla_up_proj`` latent attention's query/key/value up-projections (the kernel's
Q, K, V), ``moe_act`` the experts' activation (its output, the down-projection's
input). DeepSeek-V3 rebuilds the norms and the MLA up-projections (arXiv 2412.19437,
sec. 3.3.2) and caches the SwiGLU input, recomputing its output (sec. 3.3.3)."""
FP8_SCALED_BYTES = 1 + 4 / 128
"""An fp8 element with its share of one fp32 scale per 1 x 128 tile (DeepSeek-V3's
fine-grained activation quantization, arXiv 2412.19437 sec. 3.3.2)."""


@dataclass(frozen=True)
class Kept:
    """What the training software keeps for backward where stacks differ; the defaults
    are mtcore's own (measured, docs/plan.md). ``modules``: ``RECOMPUTE_MODULES``
    rebuilt in backward. ``dispatch_bytes``: bytes an element of the experts' dispatched
    input, kept for their first product's weight gradient (None: the compute dtype;
    ``FP8_SCALED_BYTES`` when dispatched in fp8). ``expert_output``: the experts' output
    kept to weigh it by the router's probabilities in the combine (mtcore); off where
    the probabilities are applied inside the expert, at its activation (Megatron-Core's
    ``weighted_bias_swiglu``), so the combine is a plain sum."""

    modules: frozenset[str] = frozenset()
    dispatch_bytes: float | None = None
    expert_output: bool = True


MTCORE_KEPT = Kept()


def dtype_bytes(dtype: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]


def state_bytes_per_param(
    dtype: str, zero: int, shards: int, grad_bytes: int = 4
) -> dict[str, float]:
    """Bytes per parameter: ``params``, ``grads`` (the gradient buffer, ``grad_bytes`` an
    element: mtcore's is fp32), ``master`` and ``optimizer`` (AdamW moments), sharded
    over ``shards`` ranks by ZeRO stage ``zero``: 1 the master weights and moments, 2
    also the gradients, 3 also the parameters (FSDP's full sharding)."""
    p = dtype_bytes(dtype)
    master = 0.0 if p == 4 else 4.0

    def part(stage: int) -> int:
        return shards if zero >= stage else 1

    return {
        "params": p / part(3),
        "grads": grad_bytes / part(2),
        "master": master / part(1),
        "optimizer": 8.0 / part(1),
    }


def layer_activation_bytes(
    block: Block,
    micro_batch: int,
    tp: int,
    cp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    fused_attention: bool = False,
    act_bytes: int = 2,
    kept: Kept = MTCORE_KEPT,
) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch on one rank; ``kept``
    says what the software rebuilds or narrows (``Kept``)."""
    cp = block.cp_share(cp)
    s = block.seq / cp
    b, h, e = micro_batch, block.hidden, act_bytes
    outside_div = tp if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / outside_div
    masks = MASK_BYTES * 2 if block.dropout else 0
    # Outside the tensor-parallel region: two norm inputs, the QKV and MLP inputs (the
    # norms' outputs, rebuilt under the layernorm module), masks.
    norm_tensors = 2 if "layernorm" in kept.modules else 4
    outside = s * b * h * (norm_tensors * e + masks)
    # Inside it (sharded over tp): Q, K, V, the projection's input, the MLP intermediates.
    if block.latent is not None:
        latent_outside, latent_whole, inside = _latent_bytes(block, s * b, e, recompute, kept)
        outside += latent_outside
        outside_whole = latent_whole
    else:
        inside, outside_whole = e * s * b * (2 * block.q_width + 2 * block.kv_width), 0.0
    inside += _mlp_bytes(block, s * b, e, kept)
    scores = 0.0
    if block.cross_seq:  # a second attention over the encoder tokens (T5's decoder)
        outside += e * s * b * h  # its norm's input
        inside += (
            e * s * b * 2 * block.q_width + e * (block.cross_seq / cp) * b * 2 * block.kv_width
        )
    if recompute != "selective" and "core_attn" not in kept.modules:
        scores = _score_bytes(block, s, b, e, fused_attention)
    return outside / outside_div + outside_whole + (inside + scores) / tp


def _latent_bytes(block: Block, tokens: float, e: int, recompute: str, kept: Kept = MTCORE_KEPT):
    """Multi-head latent attention's kept tensors (what mtcore's ``LatentAttention``
    saves, ``tests/unit/plan/test_latent_plan.py`` measures them): ``(outside,
    whole, inside)`` bytes. Outside the tp region (sharded by sequence parallel): each
    latent norm's input and normalised input (the key/value down-projection's output
    includes the rope key), and the rope tables (fp32 cos and sin); whole on every tp
    rank: the up-projections' inputs (gathered under sequence parallel); inside (over
    tp): the attention kernel's Q, K, V and output, padded to its head size, and the
    output projection's input (the output and its fp32 log-sum-exp, ``scores``, are
    recomputed under selective recompute). ``kept.modules``: ``layernorm`` keeps each
    latent norm's input only; ``mla_up_proj`` rebuilds the kernel's Q, K and V from the
    up-projections' inputs, keeping its output alone."""
    lat = block.latent
    norm_tensors = 1 if "layernorm" in kept.modules else 2
    outside = e * tokens * (norm_tensors * (lat.q_rank + lat.kv_rank) + lat.rope)
    outside += 4 * tokens * lat.rope
    whole = e * tokens * ((lat.q_rank or 0) + lat.kv_rank)
    selective = recompute == "selective" or "core_attn" in kept.modules
    kernel = 0 if selective else 1  # the kernel's output, which a score recompute rebuilds
    kernel += 0 if "mla_up_proj" in kept.modules else 3  # its Q, K and V
    inside = e * tokens * (kernel * block.q_width + block.heads * lat.v_dim)
    return outside, whole, inside


def kv_cache_bytes_per_token(blocks, act_bytes: int) -> float:
    """Bytes a generation cache keeps per token and sequence over ``blocks``: every
    key/value head's key and value, or latent attention's latent and rope key
    (``Block.cache_values_per_token``), in the compute dtype, one process (tp=1)."""
    return act_bytes * sum(bl.cache_values_per_token() for bl in blocks)


def _mlp_bytes(block: Block, tokens: float, e: int, kept: Kept = MTCORE_KEPT) -> float:
    """The MLP's (or experts') kept intermediates of its width: fc1's output (the
    activation's input) and fc2's input; gated, also fc3's output and silu(fc1), which
    the product's backward reads (mtcore's swiglu: ``silu(gate) * up``, unfused). The
    ``moe_act`` module keeps the experts' activation input alone (fc1's and fc3's
    outputs, or fc1's)."""
    widths = 4 if block.gated else 2
    dense = e * tokens * (block.ffn + block.shared_ffn) * widths
    if not block.experts:
        return dense
    if "moe_act" in kept.modules:
        widths = 2 if block.gated else 1
    rows = tokens * block.top_k  # routed rows this rank computes (balanced routing)
    experts = e * rows * block.expert_ffn * widths
    # the dispatched input and the expert output are outside the expert's tp split but
    # are counted here once per rank as the tp ranks each hold the same rows / tp share
    dispatched = e if kept.dispatch_bytes is None else kept.dispatch_bytes
    experts += rows * block.hidden * (dispatched + (e if kept.expert_output else 0))
    router = 4 * tokens * block.experts  # fp32 router logits
    return dense + experts + router


def _score_bytes(block: Block, s: float, b: int, e: int, fused: bool) -> float:
    """What the attention keeps of its scores: a fused kernel's fp32 log-sum-exp per
    query, or the probabilities (``e`` bytes an element; fp32 where the bias is added
    outside the kernel, ``Block.biased_attention``) with, under dropout, the dropped
    copy and the mask."""
    keys = block.kv_seq + block.cross_seq
    if fused and not block.biased_attention:
        return 4.0 * block.heads * s * b * (2 if block.cross_seq else 1)  # log-sum-exp
    if block.biased_attention:
        e = 4
    per_element = 2 * e + MASK_BYTES if block.dropout else e
    return per_element * block.heads * s * keys * b


def in_flight(schedule: str, pp: int, vpp: int, rank: int, microbatches: int) -> float:
    """Micro-batches' worth of this rank's layers whose activations are held at once: the
    schedule table's closed form (``ScheduleEntry.in_flight``); one without pipelining."""
    if pp == 1:
        return 1.0
    return schedule_entry(schedule).in_flight(pp, vpp, rank, microbatches)


def heads_in_flight(schedule: str, pp: int, vpp: int, microbatches: int) -> int:
    """Micro-batches whose loss the last stage has run forward but not yet backward, at
    most (``ScheduleEntry.heads_in_flight``: one under 1F1B, all of them under GPipe).
    Each one beyond the first keeps its ``head_saved_bytes`` until its backward."""
    if pp == 1:
        return 1
    return schedule_entry(schedule).heads_in_flight(pp, vpp, microbatches)


def backward_transient_bytes(
    block: Block,
    micro_batch: int,
    tp: int,
    ep: int,
    cp: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 2,
    received: bool = False,
) -> float:
    """What a stage's backward holds beyond the activations as it starts through its last
    layer ``block``, for one micro-batch on one rank: the gradient received from the
    next stage (``received``), then its last product's weight gradient, before it is
    added to the fp32 buffer, with the gradient of that product's input (fc2 of a dense
    MLP); for routed experts, two zero-filled gradients of this rank's stacked gate/up
    weights (each expert's slice of the stack gets a stack-sized gradient, summed into
    the one before). An attention that keeps its fp32 scores (``Block.biased_attention``)
    adds its softmax's backward: the gradients of the probabilities and of the scores, of
    the larger of its attentions (T5's decoder: the cross-attention)."""
    if not block.keeps_activations:  # run under no_grad: no backward at all
        return 0.0
    s, b, h, e = block.seq / block.cp_share(cp), micro_batch, block.hidden, act_bytes
    out = e * s * b * h / (tp if sequence_parallel else 1) if received else 0.0
    if block.biased_attention:
        out += 2 * 4 * block.heads / tp * s * b * max(block.kv_seq, block.cross_seq)
    weight_grads = 0.0 if block.frozen else 1.0  # a frozen block passes the gradient only
    if block.experts:
        branches = 2 if block.gated else 1
        stack = e * block.experts / ep * branches * block.expert_ffn / tp * h
        return out + 2 * stack * weight_grads
    inner = (block.ffn + block.shared_ffn) / tp
    return out + e * inner * h * weight_grads + e * s * b * inner


def head_saved_bytes(
    tokens: float, hidden: int, vocab: int, tp: int, sequence_parallel: bool, act_bytes: int
) -> float:
    """What one micro-batch's head keeps from its forward to its backward, on this rank:
    the final norm's input and output, and the loss's fp32 buffer of the vocabulary shard
    (the exps of the vocab-parallel cross-entropy; at tp=1 the backend's log-softmax).
    The logits themselves are freed once the loss has read them."""
    norm = 2 * act_bytes * tokens * hidden / (tp if sequence_parallel else 1)
    return norm + 4 * tokens * vocab / tp


def head_transient_bytes(
    tokens: float,
    hidden: int,
    vocab: int,
    tp: int,
    sequence_parallel: bool,
    act_bytes: int,
    trains_head: bool = True,
) -> float:
    """The last stage's loss and output layer for one micro-batch of ``tokens`` (on this
    rank): the final norm's input and output (kept for backward), with the larger of the
    loss's forward (logits in the compute dtype and their fp32 softmax) and the head's
    backward (the softmax turned logits' gradient, the output weight's gradient before it
    is added to the fp32 buffer (none when ``trains_head`` is off: a frozen language model),
    and the head input's gradient).

    At tp=1 the loss is the backend's cross-entropy, a log-softmax and NLL through autograd
    (``mtcore.ops.cross_entropy``, torch's ``F.cross_entropy``): its backward holds three
    fp32 buffers of the logits' size at once, the saved log-softmax, the NLL's gradient
    of it and the logits' gradient (``_log_softmax_backward_data``; measured with
    ``mtcore sweep``, docs/plan.md). The vocab-parallel loss (tp > 1) turns its saved
    exps into the gradient in place: one buffer. Logits narrower than fp32 (bf16) are
    widened to fp32 first, a copy alive next to the softmax in the forward, and the
    vocab-parallel gradient is narrowed back, a copy next to the fp32 one (measured:
    ``tests/unit/plan/test_memory_formulas.py``)."""
    e, v = act_bytes, vocab / tp
    narrow = e < 4
    norm = 2 * e * tokens * hidden / (tp if sequence_parallel else 1)
    forward = tokens * v * (e + 4 + 4 * narrow)
    backward = (4 + e * narrow) * tokens * v + e * v * hidden * trains_head + e * tokens * hidden
    if tp == 1:
        backward = max(backward, 3 * 4 * tokens * v)
    return norm + max(forward, backward)
