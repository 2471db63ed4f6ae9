"""The model-family seam: the contracts a family implements, and what the engine consumes.

The engine, trainer, metrics, checkpoints, HF conversion, the planner, ``mtcore
generate`` and ``mtcore doctor`` know a model only through its ``ModelFamily``; none
of them imports a concrete model (torchtitan's ``ModelSpec`` is the idea)::

    family = family_of(config)                        # config.family selects it
    built = family.build(config, layout, backend, seed, fp8)   # this rank's chunks, checked
    specs = family.messages(config, layout, micro_batch_size, dtype)
    counts = family.loss_counts(config, batch)        # before the step, from the batch

Three contracts, each checked where it is met, with a one-line ``FamilyError`` that
names the family and the member:

``FamilyConfig``
    the ``model`` section of one family (abstract: ``check_layout``, ``num_params``,
    ``flops_per_step``).
``ModelFamily``
    the family itself (abstract: ``build_chunks``, ``one_process``, ``messages``,
    ``loss_counts``, ``data``), with what varies by family declared as data
    (``capabilities``); checked when the registry hands it out (``check_family``).
``PipelineStage``
    each chunk ``build`` returns; checked on every ``build``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field

from mtcore.models.adapters import HFAdapter, MegatronAdapter, adapter_problem
from mtcore.models.shape import ModelShape, NotModelled
from mtcore.parallel.settings import Settings

# The seam describes models without building one: `mtcore plan` and the CLI's parser read
# families, configs and shapes in a process that never imports torch. Tensors and modules
# appear here only in annotations.
if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from mtcore.parallel.moe import MoESpec
    from mtcore.parallel.pipeline import TensorSpec

Batch = dict[str, "Tensor"]
"""One micro-batch: named tensors (``tokens``, ``labels``, ``padding_mask``, ...)."""


MessageSpecs = Callable[[int], dict[str, "TensorSpec"]]
"""``boundary -> {name: TensorSpec}``: what virtual stage ``boundary`` sends to stage
``boundary + 1`` (known before the step; it may differ from boundary to boundary)."""


class FamilyError(ValueError):
    """An unknown family, a family that breaks the contract, a family plugin that clashes
    or is broken, or a model section its family's config class rejects; the message
    names the family and the member or key."""


class FamilyConfig(Settings):
    """The ``model`` section of one family: its sizes and switches, validated up front.

    Every family config has ``family`` (the discriminator), ``vocab_size`` (None:
    the tokenizer's, padded to ``vocab_multiple``), ``seq_len`` and ``num_layers``.
    A subclass must answer ``check_layout``, ``num_params`` and ``flops_per_step``
    (pydantic's model class is an ``ABCMeta``: a config class without them cannot be
    instantiated).
    """

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
    @abstractmethod
    def check_layout(self, spec) -> None:
        """Raise ``LayoutError`` for a layout (``LayoutSpec``) this model cannot be split by,
        naming the numbers."""

    @abstractmethod
    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model (a tied weight counted once); ``active``: only what
        one token goes through (mixture of experts)."""

    @abstractmethod
    def flops_per_step(self, global_batch: int) -> float:
        """Model FLOPs of one optimizer step (forward + backward, no recompute), for
        TFLOP/s and MFU."""

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
    def template_layers(self) -> int:
        """How many first layers a template model (this config with fewer layers) keeps
        so that every layer's parameter names and shapes appear among them: 1 for a
        uniform stack. Checkpoint tools build that template instead of the whole model."""
        return 1

    def template_layer(self, index: int) -> int:
        """The template's layer (below ``template_layers``) whose parameter names and
        shapes layer ``index`` has."""
        return 0

    @property
    def experts(self) -> MoESpec | None:
        """The mixture-of-experts layers' settings, None for a dense model (a family
        whose configs can have them declares ``capabilities.mixture_of_experts``)."""
        return None

    @property
    def num_moe_layers(self) -> int:
        """How many layers are mixture-of-experts layers (0 for a dense model)."""
        return 0


@dataclass
class BuiltModel:
    """This rank's share of a model: its pipeline chunks (chunk 0 first) and the
    model-parallel RNG tracker they draw dropout from (checkpoints save its state)."""

    chunks: list[nn.Module]
    rng_tracker: Any


class PipelineStage(Protocol):
    """A pipeline chunk, as ``ModelFamily.build`` returns it (an ``nn.Module``).

    ``first`` / ``last``: whether it is virtual stage 0 / the last virtual stage;
    ``tp``: its tensor-parallel group (``mtcore.parallel.tensor.TPGroup``), over which
    the engine unshards the chunk's weights (``full_state_dict``); ``layers``: its
    transformer blocks, each global layer index (a string, as parameter names hold it)
    to its module (an ``nn.ModuleDict``): the units ZeRO-3 shards and gathers one at a
    time (the params outside them stay whole). These and the methods below are all the
    engine reads of a chunk besides ``nn.Module``'s own.
    """

    first: bool
    last: bool
    tp: Any
    layers: Any  # nn.ModuleDict: layer index -> block

    def stage(self, inputs: dict[str, Tensor], batch: Batch) -> dict[str, Tensor]:
        """``inputs``: the named tensors received from the previous stage (``{}`` on
        stage 0); ``batch``: the whole micro-batch (every stage may read its side inputs,
        e.g. a padding mask). Returns the named tensors for the next stage, exactly
        ``specs(boundary)`` in shape and dtype, or on the last stage the head outputs
        that ``loss`` takes."""
        ...

    def loss(self, outputs: dict[str, Tensor], batch: Batch) -> dict[str, tuple[Tensor, Tensor]]:
        """Last stage only: ``{term: (sum, count)}``, each term a sum over its elements and
        their number (the count equals ``loss_counts(config, batch)[term]``). The
        training loss is the sum over terms of ``global sum / global count``:
        token-weighted over micro-batches, dp and cp, so it equals one process whatever
        the split."""
        ...

    def metrics(self, outputs: dict[str, Tensor], batch: Batch) -> dict[str, tuple[Tensor, Tensor]]:
        """Last stage only, evaluation: ``{name: (sum, count)}`` (accuracies); may be ``{}``."""
        ...

    def tied_copies(self) -> list[nn.Parameter]:
        """This chunk's halves of parameters tied across pipeline stages (their gradients
        are summed)."""
        ...

    def own_parameter_names(self) -> list[str]:
        """The parameters that belong in a checkpoint (not the tied copies, whose names
        ``ModelFamily.checkpoint_aliases`` maps to the twin they load from)."""
        ...


STAGE_MEMBERS = ("first", "last", "tp", "stage", "loss", "metrics", "tied_copies",
                 "own_parameter_names", "layers")  # fmt: skip
"""Every member of ``PipelineStage``, in the order a missing one is reported."""


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
    ``Loader`` over ``train`` or ``valid``. ``loader_takes_group``: it also takes
    ``group=`` (``mtcore.data.loader.SampleGroup``, the ranks of one model replica), for
    decisions its ranks must share (a loader that reads files as it draws samples drops
    the same ones on every rank when a file changes under the job)."""

    tokenizer: Any
    train: Any
    valid: Any | None
    loader: Callable[..., Loader]
    loader_takes_group: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What varies by family, declared (never probed from code):

    generates: ``generate`` continues a prompt (``mtcore generate``, the trainer's sample);
    reads_images: ``generate`` takes ``image=`` and its batches carry pixels;
    mixture_of_experts: its configs may have MoE layers (``FamilyConfig.experts``);
    context_parallel: it trains under cp > 1 with some ``parallel.cp_method`` (its
      ``check_layout`` refuses cp otherwise, and the methods it does not take).
    """

    generates: bool = False
    reads_images: bool = False
    mixture_of_experts: bool = False
    context_parallel: bool = False


class ModelFamily(ABC):
    """Everything the engine, trainer, checkpoints, planner and CLI need to know about a
    family. A family is a subclass with the class attributes below and the abstract
    methods implemented, registered as an instance (``FAMILY = MyFamily()``).

    name: the ``model.family`` value that selects it.
    config: its ``FamilyConfig`` subclass (``family: Literal[name]``).
    capabilities: what it can do (``Capabilities``).
    checkpoint_aliases: a tied copy's name -> the name of the twin it loads from.
    hf: its HuggingFace adapter (an ``HFAdapter`` subclass), or None; megatron: its
    Megatron adapter (a ``MegatronAdapter`` subclass), or None.
    description: one line for ``mtcore doctor``.
    """

    name: ClassVar[str]
    config: ClassVar[type[FamilyConfig]]
    capabilities: ClassVar[Capabilities] = Capabilities()
    checkpoint_aliases: ClassVar[Mapping[str, str]] = MappingProxyType({})
    hf: ClassVar[type[HFAdapter] | None] = None
    megatron: ClassVar[type[MegatronAdapter] | None] = None
    description: ClassVar[str] = ""

    # -- what a family implements ------------------------------------------------------
    @abstractmethod
    def build_chunks(self, config, layout, backend, seed: int = 0, fp8=None) -> BuiltModel:
        """This rank's pipeline chunks (each a ``PipelineStage``), chunk 0 first, and the
        RNG tracker they share. Called through ``build``, which checks them."""

    @abstractmethod
    def one_process(self, config, backend=None) -> nn.Module:
        """The whole model in one process (tp=1, pp=1), named as every layout's chunks
        are; its ``state_dict`` is the family's "full weights"."""

    @abstractmethod
    def messages(self, config, layout, micro_batch_size: int, dtype: torch.dtype) -> MessageSpecs:
        """What crosses each pipeline boundary, known before the step."""

    @abstractmethod
    def loss_counts(self, config, batch: Batch) -> dict[str, Tensor]:
        """``{term: count}`` of a micro-batch, computed on every rank before the step, so
        each micro-batch's loss can be weighted by its share of the global count."""

    @abstractmethod
    def data(self, data_config, model_config) -> FamilyData:
        """The family's data pipeline (``models/<family>/data.py``)."""

    def metric_names(self, config) -> tuple[str, ...]:
        """Names of what ``chunk.metrics`` returns (evaluation)."""
        return ()

    def sequence_lengths(self, config) -> int | Mapping[str, int | None]:
        """How a micro-batch splits over context-parallel ranks: the sequence length of
        every ``[b, s, ...]`` tensor (``config.seq_len``), or a mapping from tensor name
        to its own length, None for a tensor every cp rank keeps whole
        (``mtcore.parallel.context.shard_batch``)."""
        return config.seq_len

    def shape(self, config) -> ModelShape:
        """The planner's view of ``config`` (``mtcore plan``); a family without one is
        refused in one line."""
        raise NotModelled(
            f"the planner does not model the {self.name!r} family: it provides no shape "
            "(ModelFamily.shape), so its memory and step time are not predicted"
        )

    def generate(self, model, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
                 temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
        """The prompt's continuation by the one-process ``model`` (greedy, or top-k
        sampling with ``generator``); ``image``: a path, for a family that reads images.
        Only for a family that declares ``capabilities.generates``."""
        raise FamilyError(f"the {self.name} family does not generate text")

    # -- what the seam adds ------------------------------------------------------------
    def build(self, config, layout, backend, seed: int = 0, fp8=None) -> BuiltModel:
        """``build_chunks``, with every chunk checked against ``PipelineStage`` and a
        config with MoE layers checked against ``capabilities``."""
        if config.experts is not None and not self.capabilities.mixture_of_experts:
            raise FamilyError(
                f"model family {self.name!r}: the config has mixture-of-experts layers but "
                "the family does not declare capabilities.mixture_of_experts"
            )
        built = self.build_chunks(config, layout, backend, seed, fp8)
        for index, chunk in enumerate(built.chunks):
            missing = next((m for m in STAGE_MEMBERS if not hasattr(chunk, m)), None)
            if missing is not None:
                raise FamilyError(
                    f"model family {self.name!r}: chunk {index} ({type(chunk).__name__}) "
                    f"has no {missing!r} (mtcore.models.PipelineStage)"
                )
            if not callable(getattr(chunk.layers, "values", None)):  # nn.ModuleDict, a dict
                raise FamilyError(
                    f"model family {self.name!r}: chunk {index} ({type(chunk).__name__}) "
                    f"has 'layers' of type {type(chunk.layers).__name__}, not a mapping of "
                    "layer index to block (mtcore.models.PipelineStage)"
                )
        return built


# The arguments each member is called with: a family's method must accept them.
_CALLS: dict[str, tuple[tuple, dict]] = {
    "build_chunks": (("config", "layout", "backend", 0, None), {}),
    "one_process": (("config", "backend"), {}),
    "messages": (("config", "layout", 1, "dtype"), {}),
    "loss_counts": (("config", {}), {}),
    "data": (("data_config", "model_config"), {}),
    "metric_names": (("config",), {}),
    "sequence_lengths": (("config",), {}),
    "shape": (("config",), {}),
    "generate": (("model", "tokenizer", "prompt", 1, None, 1.0, None), {"image": None}),
}


def check_family(family: object, source: str = "") -> ModelFamily:
    """``family`` if it keeps the contract, else a one-line ``FamilyError`` naming it
    (and ``source``, e.g. the plugin) and the member at fault."""
    where = f" ({source})" if source else ""
    if not isinstance(family, ModelFamily):
        raise FamilyError(f"{type(family).__name__}{where} is not a mtcore.models.ModelFamily")
    name = getattr(family, "name", None)
    label = f"model family {name!r}{where}"
    if not isinstance(name, str) or not name:
        raise FamilyError(f"{type(family).__name__}{where}: ModelFamily.name must be a string")
    config = getattr(family, "config", None)
    field = config.model_fields.get("family") if isinstance(config, type) and issubclass(
        config, FamilyConfig) else None  # fmt: skip
    if field is None or field.default != name:
        raise FamilyError(
            f"{label}: config must be a FamilyConfig subclass with family: Literal[{name!r}] "
            f"= {name!r}"
        )
    caps = family.capabilities
    if not isinstance(caps, Capabilities):
        raise FamilyError(f"{label}: capabilities must be a mtcore.models.Capabilities")
    overrides_generate = type(family).generate is not ModelFamily.generate
    if caps.generates != overrides_generate or (caps.reads_images and not caps.generates):
        raise FamilyError(
            f"{label}: capabilities.generates={caps.generates} (reads_images="
            f"{caps.reads_images}) but the family {'defines' if overrides_generate else 'lacks'} "
            "generate(...)"
        )
    for adapter, kind in ((family.hf, HFAdapter), (family.megatron, MegatronAdapter)):
        problem = adapter_problem(adapter, kind)
        if problem:
            raise FamilyError(f"{label}: {problem}")
    for member, (args, kwargs) in _CALLS.items():
        try:
            inspect.signature(getattr(family, member)).bind(*args, **kwargs)
        except TypeError as e:
            raise FamilyError(f"{label}: {member}(...) breaks the contract: {e}") from None
    return family
