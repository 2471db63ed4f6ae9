"""LoRA on a family's blocks: which linears the targets name, and adding the adapters.

``finetune.lora.targets`` names linears the way the blocks do:

=========  ==================================================  =====================
target     linear                                              PEFT's Llama name
=========  ==================================================  =====================
q, k, v    sections of ``attn.qkv`` (one adapter each)         q_proj, k_proj, v_proj
o          ``attn.proj``                                       o_proj
fc1        ``mlp.fc1`` (SwiGLU: gate and up, one each)         gate_proj, up_proj
fc2        ``mlp.fc2``                                         down_proj
q_up       multi-head latent attention's ``attn.q_up``         q_b_proj
kv_up      its ``attn.kv_up``                                  kv_b_proj
=========  ==================================================  =====================

Multi-head latent attention without ``q_lora_rank`` takes ``q`` for its ``attn.q``;
``fc1`` / ``fc2`` also adapt a MoE layer's shared expert. The routed experts and
the replicated down projections of latent attention are not adapted (not built).

``add_lora`` freezes every parameter of the chunks, then gives each target linear a
``lora`` submodule (``mtcore.parallel.tensor.lora``): its adapters are the only
trainable parameters, named ``layers.3.attn.qkv.lora.q.A`` at any layout. Each adapter
draws from the generator of its own name (``Context.generator``), so a pipeline stage
that holds only some layers starts from one process's numbers.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from mtcore.parallel.settings import Settings

ATTENTION_TARGETS = ("q", "k", "v", "o")
LATENT_TARGETS = ("q", "q_up", "kv_up", "o")
MLP_TARGETS = ("fc1", "fc2")
ALL_TARGETS = ("q", "k", "v", "o", "fc1", "fc2", "q_up", "kv_up")


class LoRAConfig(Settings):
    """``finetune.lora``: the adapters' rank, ``alpha`` (scale ``alpha / rank``), the
    dropout on their input and the target linears (PEFT's defaults: r=8, alpha=8,
    targets q and v)."""

    rank: int = Field(8, ge=1, description="r: the adapters' inner dimension")
    alpha: float = Field(8.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: tuple[str, ...] = Field(
        ("q", "v"),
        min_length=1,
        description=f"linears to adapt, of {', '.join(ALL_TARGETS)}",
    )

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {unknown[0]!r}; known: {', '.join(ALL_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"a LoRA target is named twice in {targets}")
        return targets

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_targets(lora: LoRAConfig, model_config) -> None:
    """ValueError (one line) when a target names no linear of this model."""
    mla = getattr(model_config, "mla", None)
    if mla is None:
        allowed = ATTENTION_TARGETS + MLP_TARGETS
    else:
        query = ("q",) if mla.q_lora_rank is None else ("q_up",)
        allowed = (*query, "kv_up", "o", *MLP_TARGETS)
    wrong = [t for t in lora.targets if t not in allowed]
    if wrong:
        kind = "multi-head latent attention" if mla is not None else "this attention"
        raise ValueError(
            f"finetune.lora.targets: {wrong[0]!r} names no linear of {kind}; "
            f"it has {', '.join(allowed)}"
        )


def lora_sites(chunk) -> list[tuple[str, object, str, list[tuple[str, int]]]]:
    """``(module name, linear, "column" | "row", [(section, full size), ...])`` of every
    linear a target can name, with the target each section answers to as its name
    (``fc1``'s gate and up both answer to ``fc1``: ``section_target``)."""
    from mtcore.models.common.latent_attention import LatentAttention
    from mtcore.models.common.layers import MLP, Attention
    from mtcore.parallel.moe.layer import SharedExpert

    sites = []
    for name, module in chunk.named_modules():
        if isinstance(module, Attention):
            q = module.heads * module.d * module.c.tp.size
            kv = module.kv_heads * module.d * module.c.tp.size
            sites.append((f"{name}.qkv", module.qkv, "column", [("q", q), ("k", kv), ("v", kv)]))
            sites.append((f"{name}.proj", module.proj, "row", [("o", module.proj.out_features)]))
        elif isinstance(module, LatentAttention):
            for attr, target in (("q", "q"), ("q_up", "q_up"), ("kv_up", "kv_up")):
                linear = getattr(module, attr, None)
                if linear is not None:
                    sections = [(target, linear.out_features)]
                    sites.append((f"{name}.{attr}", linear, "column", sections))
            sites.append((f"{name}.proj", module.proj, "row", [("o", module.proj.out_features)]))
        elif isinstance(module, MLP | SharedExpert):
            fc1, f = module.fc1, module.fc2.in_features
            sections = [("gate", f), ("up", f)] if module.swiglu else [("fc1", f)]
            sites.append((f"{name}.fc1", fc1, "column", sections))
            sites.append((f"{name}.fc2", module.fc2, "row", [("fc2", module.fc2.out_features)]))
    return sites


def section_target(section: str) -> str:
    """The target that adapts a section (gate and up are fc1's)."""
    return "fc1" if section in ("gate", "up") else section


def add_lora(chunks, lora: LoRAConfig) -> int:
    """Freeze every parameter of ``chunks`` and add the adapters ``lora`` names; the
    number of adapted linears on this rank. ValueError when the chunks hold blocks but
    no target linear (a family with blocks of its own, such as T5)."""
    from mtcore.parallel.tensor.lora import LoRA, SectionAdapters

    for chunk in chunks:
        check_targets(lora, chunk.config)
        chunk.requires_grad_(False)
    wanted, adapted = set(lora.targets), 0
    for chunk in chunks:
        c = chunk.c
        for name, linear, parallel, sections in lora_sites(chunk):
            chosen = {}
            for section, size in sections:
                if section_target(section) not in wanted:
                    continue
                chosen[section] = LoRA(
                    parallel, linear.in_features, size,
                    c.tp, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                    sequence_parallel=linear.sequence_parallel,
                    generator=c.generator(f"{name}.lora.{section}"), tracker=c.tracker,
                    device=c.device,
                )  # fmt: skip
            if chosen:
                linear.lora = SectionAdapters(sections, chosen, c.tp, parallel)
                adapted += 1
    blocks = sum(len(getattr(chunk, "layers", ())) for chunk in chunks)
    if blocks and not adapted:  # a family whose blocks are its own (T5's attention)
        raise ValueError(
            f"finetune.lora: no linear of this {chunks[0].config.family} model answers to "
            f"{', '.join(lora.targets)}: LoRA adapts the blocks mtcore's families share "
            "(GPT, BERT, LLaVA), not this family's own"
        )
    return adapted


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``...lora.<section>.A`` or ``.B``)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-3] == "lora" and parts[-1] in ("A", "B")
