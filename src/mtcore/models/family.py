"""The model-family seam: what a family supplies, and what the engine and trainer consume.

The engine, trainer, metrics, checkpoints, HF conversion, ``mtcore generate`` and
``mtcore doctor`` know a model only through its ``ModelFamily``; none of them
imports a concrete model. A family is a frozen record of a config class and a few
functions (torchtitan's ``ModelSpec`` is the idea)::

    family = family_of(config)                        # config.family selects it
    built = family.build(config, layout, backend, seed, fp8)   # this rank's chunks
    specs = family.messages(config, layout, micro_batch_size, dtype)
    counts = family.loss_counts(config, batch)        # before the step, from the batch

The chunk contract (each element of ``built.chunks``, an ``nn.Module``):

``chunk.first`` / ``chunk.last``
    whether it is virtual stage 0 / the last virtual stage.
``chunk.tp``
    its tensor-parallel group (``mtcore.parallel.tensor.TPGroup``): the engine
    unshards the chunk's weights over it (``full_state_dict``).
``chunk.stage(inputs, batch) -> outputs``
    ``inputs``: the named tensors received from the previous stage (``{}`` on
    stage 0); ``batch``: the whole micro-batch (every stage may read its side
    inputs, e.g. a padding mask). It returns the named tensors for the next stage,
    exactly ``specs(boundary)`` in shape and dtype, or, on the last stage, the head
    outputs that ``loss`` takes.
``chunk.loss(outputs, batch) -> {term: (sum, count)}``
    last stage only. Each term is a sum over its elements and their number (the
    count equals ``loss_counts(config, batch)[term]``). The training loss is the sum
    over terms of ``global sum / global count``: token-weighted over micro-batches,
    dp and cp, so it equals one process whatever the split.
``chunk.metrics(outputs, batch) -> {name: (sum, count)}``
    last stage only, evaluation: e.g. accuracies. May return ``{}``.
``chunk.tied_copies()``
    its halves of parameters tied across pipeline stages (their gradients are summed).
``chunk.own_parameter_names()``
    the parameters that belong in a checkpoint (not the tied copies, whose names
    ``ModelFamily.checkpoint_aliases`` maps to the twin they load from).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor, nn

from mtcore.distributed.layout import reject_bool_numbers
from mtcore.parallel.pipeline import TensorSpec

Batch = dict[str, Tensor]
"""One micro-batch: named tensors (``tokens``, ``labels``, ``padding_mask``, ...)."""


MessageSpecs = Callable[[int], dict[str, TensorSpec]]
"""``boundary -> {name: TensorSpec}``: what virtual stage ``boundary`` sends to stage
``boundary + 1`` (known before the step; it may differ from boundary to boundary)."""


class FamilyConfig(BaseModel):
    """The ``model`` section of one family: its sizes and switches, validated up front.

    Every family config has ``family`` (the discriminator), ``vocab_size`` (None:
    the tokenizer's, padded to ``vocab_multiple``), ``seq_len`` and ``num_layers``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Every family's sizes and counts: ``num_layers: true`` is an error, not 1 layer.
    _no_bool_numbers = field_validator("*", mode="before")(reject_bool_numbers)

    family: str
    vocab_size: int | None = Field(None, ge=2, description="None: the tokenizer's, padded")
    vocab_multiple: int = Field(128, ge=1, description="pad the tokenizer's vocab to this")
    seq_len: int = Field(256, ge=1)
    num_layers: int = Field(4, ge=1)

    def with_vocab(self, tokenizer_vocab: int):
        """This config with ``vocab_size`` fixed for a tokenizer of ``tokenizer_vocab`` ids.

        None becomes the tokenizer's size rounded up to ``vocab_multiple`` (a vocab
        shard per tp rank, and friendlier matmul shapes); a set size smaller than
        the tokenizer's is an error: those token ids would have no embedding row.
        """
        if self.vocab_size is None:
            padded = -(-tokenizer_vocab // self.vocab_multiple) * self.vocab_multiple
            return self.model_copy(update={"vocab_size": padded})
        if self.vocab_size < tokenizer_vocab:
            raise ValueError(
                f"the tokenizer has {tokenizer_vocab} token ids but model.vocab_size is "
                f"{self.vocab_size}; set model.vocab_size >= {tokenizer_vocab} (or leave it "
                "unset to take the tokenizer's)"
            )
        return self

    # -- what every family answers -----------------------------------------------------
    def check_layout(self, spec) -> None:
        """Raise ``LayoutError`` for a layout (``LayoutSpec``) this model cannot be split by,
        naming the numbers."""
        raise NotImplementedError

    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model (a tied weight counted once); ``active``: only what
        one token goes through (mixture of experts)."""
        raise NotImplementedError

    def flops_per_step(self, global_batch: int) -> float:
        """Model FLOPs of one optimizer step (forward + backward, no recompute), for
        TFLOP/s and MFU."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the trainer's banner, e.g. ``GPT (llama) 1.2M params, 4 layers``."""
        return f"{self.family} {self.num_params() / 1e6:.2f}M params, {self.num_layers} layers"

    def structure(self) -> dict[str, Any]:
        """The fields that decide which parameters exist and their shapes: a checkpoint
        whose saved config differs here holds another architecture."""
        return {"family": self.family, "vocab_size": self.vocab_size, "num_layers": self.num_layers}

    def numerics(self) -> dict[str, Any]:
        """Fields that change what the model computes but not its parameters (a
        difference is reported at load, not refused)."""
        return {}

    @property
    def layer_period(self) -> int:
        """Layers ``0..k-1`` stand for every layer's parameter names and shapes (the MoE
        period for a GPT with ``moe_layer_freq``; 1 for a uniform stack)."""
        return 1


@dataclass
class BuiltModel:
    """This rank's share of a model: its pipeline chunks (chunk 0 first) and the
    model-parallel RNG tracker they draw dropout from (checkpoints save its state)."""

    chunks: list[nn.Module]
    rng_tracker: Any


class Loader(Protocol):
    """A family's micro-batch loader: endless, deterministic, resumable."""

    def __next__(self) -> Batch: ...
    def __iter__(self) -> Iterator[Batch]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class FamilyData:
    """What a family's data pipeline gives the trainer. ``loader(dataset, *,
    micro_batch_size, global_batch_size, dp_rank, dp_size, seed)`` makes a
    ``Loader`` over ``train`` or ``valid``."""

    tokenizer: Any
    train: Any
    valid: Any | None
    loader: Callable[..., Loader]


@dataclass(frozen=True)
class HFAdapter:
    """A family's HuggingFace interop. ``model_types``: the ``model_type`` values of a
    transformers ``config.json`` it imports. ``import_dir(path, seq_len) -> (config,
    full weights)``; ``export_dir(config, weights, out_dir, dtype, tokenizer_json)``
    returns the directory it wrote. ``tokenizer_tokens``: special tokens an imported
    ``tokenizer.json`` must hold for the family's data pipeline (BERT's ``[CLS]``...)."""

    model_types: tuple[str, ...]
    import_dir: Callable[..., tuple[FamilyConfig, dict[str, Tensor]]]
    export_dir: Callable[..., Any]
    tokenizer_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFamily:
    """Everything the engine, trainer, checkpoints and CLI need to know about a family.

    name: the ``model.family`` value that selects it.
    config: its ``FamilyConfig`` subclass (``family: Literal[name]``).
    build(config, layout, backend, seed, fp8) -> BuiltModel: this rank's chunks.
    one_process(config, backend) -> nn.Module: the whole model in one process (tp=1,
        pp=1), named as every layout's chunks are; its ``state_dict`` is the
        family's "full weights".
    messages(config, layout, micro_batch_size, dtype) -> MessageSpecs.
    loss_counts(config, batch) -> {term: count}: computed on every rank before the
        step, so each micro-batch's loss can be weighted by its share of the global
        count before its backward.
    data(data_config, model_config) -> FamilyData.
    checkpoint_aliases: a tied copy's name -> the name of the twin it loads from.
    hf: its HuggingFace adapter, or None.
    metric_names(config) -> names of what ``chunk.metrics`` returns (evaluation).
    generate(model, tokenizer, prompt, max_new_tokens, top_k, temperature, generator)
        -> text, or None when the family does not generate (the trainer then skips
        the sample).
    """

    name: str
    config: type[FamilyConfig]
    build: Callable[..., BuiltModel]
    one_process: Callable[..., nn.Module]
    messages: Callable[..., MessageSpecs]
    loss_counts: Callable[[FamilyConfig, Batch], dict[str, Tensor]]
    data: Callable[..., FamilyData]
    checkpoint_aliases: Mapping[str, str] = field(default_factory=dict)
    metric_names: Callable[[FamilyConfig], tuple[str, ...]] = lambda config: ()
    hf: HFAdapter | None = None
    generate: Callable[..., str] | None = None
    description: str = ""
