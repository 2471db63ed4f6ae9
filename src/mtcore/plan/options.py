"""What the planner assumes about the software a layout runs on: ``Options``.

These are facts about the training software, not the layout: whether attention is a
fused (flash) kernel, which communication overlaps compute, the dtype gradients are
accumulated and reduced in, the ZeRO stage, and whether a tensor-parallel group may
span nodes. Each is a ``mtcore plan`` option and a ``--compare`` key; the report says
which value it assumed and where that value came from (``Options.assumed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mtcore.plan.data_parallel import FSDP_REDUCE, Fsdp
from mtcore.plan.memory import FP8_SCALED_BYTES, RECOMPUTE_MODULES, Kept
from mtcore.plan.network import RANK_ORDERS

DP_OVERLAP = ("mtcore", "none", "full")
"""How the data-parallel gradient reduction meets backward: ``mtcore`` as the trainer
does it (overlapped with the last micro-batch's backward at pp=1, after the pipeline
at pp>1), ``none`` (always after backward) or ``full`` (always overlapped)."""
OVERLAP_AXES = ("tp", "cp", "ep", "pp")
GRAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
ZERO_STAGES = (0, 1, 2, 3)
MOE_DISPATCH = ("compute", "fp8")
MOE_PROBS = ("combine", "expert")


class OptionsError(ValueError):
    """An option value the planner cannot take (the message names it)."""


@dataclass(frozen=True)
class Options:
    """Planner settings that are facts about the software measured, not the layout.

    dp_overlap: see ``DP_OVERLAP``. fused_attention: a flash-style attention kernel
    (Megatron's ``--use-flash-attn``); None takes the hardware file's.
    grad_reduce_dtype: the dtype of the gradient buffers and of the data-parallel
    reduction (Megatron's ``--grad-reduce-in-bf16``). mtcore accumulates and reduces
    fp32 buffers; Megatron in 2021 reduced fp16 ones; Megatron-Core in bf16 fp32 ones
    (its arguments.py turns ``accumulate_allreduce_grads_in_fp32`` on for bf16).
    overlapped: axes whose communication the software hides behind compute
    (Megatron-Core's ``--tp-comm-overlap``, its overlapped p2p); mtcore: none. Only what
    exceeds the micro-batch's compute stays exposed.
    zero: the ZeRO stage, None: the config's ``parallel.zero`` (``zero1`` is 1). 2 and 3 shard
    the gradients (reduce-scattered every micro-batch) and 3 the parameters too
    (all-gathered layer by layer for each micro-batch's forward and again for its
    backward): DeepSpeed's ZeRO-2/3, FSDP's SHARD_GRAD_OP / FULL_SHARD. mtcore trains
    all four (``parallel.zero``; its ZeRO-3 keeps params outside the blocks whole).
    cross_node: let a tp group (or an ep x tp block) span nodes; it is priced on the
    network. Off: such a layout is refused.
    recompute_modules: sub-modules rebuilt in backward (``memory.RECOMPUTE_MODULES``,
    Megatron-Core's ``--recompute-modules``), beside ``model.recompute``.
    moe_dispatch: the dtype the experts' input is dispatched and kept in: ``compute``
    (mtcore) or ``fp8`` (DeepSeek-V3's fp8 dispatch, scales per 1 x 128 tile).
    moe_probs: where the router's probabilities weigh the experts' output: ``combine``
    (mtcore: the output is kept for it) or ``expert`` (at the activation, Megatron-Core's
    ``weighted_bias_swiglu``: nothing of the output kept).
    rank_order: how ranks are numbered (``network.RANK_ORDERS``): ``tp-cp-dp-pp``
    (mtcore's) or ``tp-cp-pp-dp`` (Llama 3's; dp is then priced across pipelines'
    spans; expert parallel is refused with it).
    fsdp_reshard, fsdp_reduce, fsdp_prefetch: FSDP's switches under ZeRO-3
    (``data_parallel.Fsdp``): reshard after forward (FULL_SHARD) or not
    (SHARD_GRAD_OP-like), reduce-scatter the gradients every ``microbatch`` or once a
    ``step`` (unsharded gradients accumulate), units gathered ahead (0: none).
    fp8_experts: under ``precision.fp8``, the routed and shared experts' products run in
    FP8 too (DeepSeek-V3's recipe); mtcore keeps them in the model dtype.
    moe_node_limit: each token's experts on at most this many nodes, a token sent once
    per node (DeepSeek-V3's node-limited routing, 4; ``network.node_limited_all_to_all``);
    None: mtcore's routing, every routed row sent to its expert's rank.
    """

    dp_overlap: str = "mtcore"
    fused_attention: bool | None = None
    grad_reduce_dtype: str = "fp32"
    overlapped: tuple[str, ...] = ()
    zero: int | None = None
    cross_node: bool = False
    recompute_modules: tuple[str, ...] = ()
    moe_dispatch: str = "compute"
    moe_probs: str = "combine"
    rank_order: str = RANK_ORDERS[0]
    fsdp_reshard: bool = True
    fsdp_reduce: str = "microbatch"
    fsdp_prefetch: int = 1
    fp8_experts: bool = False
    moe_node_limit: int | None = None

    def __post_init__(self):
        if self.dp_overlap not in DP_OVERLAP:
            raise OptionsError(
                f"dp overlap must be one of {', '.join(DP_OVERLAP)}, not {self.dp_overlap!r}"
            )
        if self.fused_attention is not None and not isinstance(self.fused_attention, bool):
            raise OptionsError(f"flash attention must be on or off, not {self.fused_attention!r}")
        if self.grad_reduce_dtype not in GRAD_DTYPES:
            raise OptionsError(
                f"gradient reduction dtype must be one of {', '.join(GRAD_DTYPES)}, "
                f"not {self.grad_reduce_dtype!r}"
            )
        unknown = [a for a in self.overlapped if a not in OVERLAP_AXES]
        if unknown or len(set(self.overlapped)) != len(self.overlapped):
            raise OptionsError(
                f"comm overlap takes distinct axes of {', '.join(OVERLAP_AXES)} (or none), "
                f"not {','.join(self.overlapped)!r}"
            )
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in ZERO_STAGES):
            raise OptionsError(f"ZeRO stage must be 0, 1, 2 or 3, not {self.zero!r}")
        if not isinstance(self.cross_node, bool):
            raise OptionsError(f"cross-node groups must be on or off, not {self.cross_node!r}")
        limit = self.moe_node_limit
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise OptionsError(f"moe node limit must be a whole number >= 1, not {limit!r}")
        if not isinstance(self.fp8_experts, bool):
            raise OptionsError(f"fp8 experts must be on or off, not {self.fp8_experts!r}")
        if not isinstance(self.fsdp_reshard, bool):
            raise OptionsError(f"fsdp reshard must be on or off, not {self.fsdp_reshard!r}")
        prefetch = self.fsdp_prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise OptionsError(f"fsdp prefetch must be a whole number >= 0, not {prefetch!r}")
        modules = self.recompute_modules
        if any(m not in RECOMPUTE_MODULES for m in modules) or len(set(modules)) != len(modules):
            raise OptionsError(
                f"recompute modules take distinct names of {', '.join(RECOMPUTE_MODULES)} "
                f"(or none), not {','.join(modules)!r}"
            )
        for name, value, choices in (
            ("moe dispatch", self.moe_dispatch, MOE_DISPATCH),
            ("moe probs", self.moe_probs, MOE_PROBS),
            ("rank order", self.rank_order, RANK_ORDERS),
            ("fsdp reduce", self.fsdp_reduce, FSDP_REDUCE),
        ):
            if value not in choices:
                raise OptionsError(f"{name} must be one of {', '.join(choices)}, not {value!r}")

    @property
    def grad_bytes(self) -> int:
        return GRAD_DTYPES[self.grad_reduce_dtype]

    @cached_property
    def fsdp(self) -> Fsdp:
        return Fsdp(self.fsdp_reshard, self.fsdp_reduce, self.fsdp_prefetch)

    @cached_property
    def kept(self) -> Kept:
        """What the software keeps for backward (``memory.Kept``)."""
        return Kept(
            modules=frozenset(self.recompute_modules),
            dispatch_bytes=FP8_SCALED_BYTES if self.moe_dispatch == "fp8" else None,
            expert_output=self.moe_probs == "combine",
        )

    def _fsdp_text(self) -> str:
        reshard = "reshard" if self.fsdp_reshard else "no reshard"
        return f"{reshard}, reduce once a {self.fsdp_reduce}, prefetch {self.fsdp_prefetch}"

    def zero_stage(self, config) -> int:
        return self.zero if self.zero is not None else config.parallel.zero_stage

    def flash(self, hardware) -> bool:
        return hardware.fused_attention if self.fused_attention is None else self.fused_attention

    def assumed(self, config, hardware) -> dict[str, str]:
        """Each software assumption of a plan, as the report prints it, with its source."""
        flash = "on" if self.flash(hardware) else "off"
        flash += f" ({hardware.name} file)" if self.fused_attention is None else ""
        zero = str(self.zero_stage(config))
        zero += " (parallel.zero)" if self.zero is None else ""
        stack = {  # the keep-for-backward options, named where they differ from mtcore's
            "recompute modules": ",".join(self.recompute_modules),
            "moe dispatch": "" if self.moe_dispatch == "compute" else self.moe_dispatch,
            "moe probs": "" if self.moe_probs == "combine" else f"in the {self.moe_probs}",
            "rank order": "" if self.rank_order == RANK_ORDERS[0] else self.rank_order,
            "fsdp": "" if self.fsdp == Fsdp() else self._fsdp_text(),
            "fp8 experts": "on" if self.fp8_experts else "",
            "moe node limit": str(self.moe_node_limit or ""),
        }
        return {
            "flash attention": flash,
            "comm overlap": ",".join(self.overlapped) or "none",
            "dp overlap": self.dp_overlap,
            "grad reduce dtype": self.grad_reduce_dtype,
            "zero": zero,
            "vpp": str(config.parallel.vpp),
            "cross-node groups": "allowed" if self.cross_node else "refused",
        } | {key: value for key, value in stack.items() if value}
