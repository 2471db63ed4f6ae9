"""The ``gmlp`` family: its config class and what mtcore's engine and trainer consume.

A causal gMLP (Liu et al. 2021, "Pay Attention to MLPs"): no attention and no
position embeddings. Each block mixes tokens with a learned lower-triangular
``[seq_len, seq_len]`` matrix per gate head (``model.py``). Selected in a training
config by ``model.family: gmlp``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from mtcore.models import Capabilities, FamilyConfig, FamilyData, ModelFamily, TensorSpec
from mtcore.parallel.layout import LayoutError

IGNORE_INDEX = -100  # label of a position without a next token (none in packed data)


class GMLPConfig(FamilyConfig):
    """A causal gMLP language model. ``vocab_size=None`` is filled in from the tokenizer."""

    family: Literal["gmlp"] = "gmlp"
    hidden_size: int = Field(128, ge=1)
    gate_size: int = Field(256, ge=1, description="width of the spatial gating unit")
    gate_heads: int = Field(4, ge=1, description="token-mixing matrices per block (split over tp)")
    seq_len: int = Field(128, ge=1, description="the token-mixing matrices are seq_len x seq_len")
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = Field(1e-5, gt=0)
    bias: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_std: float = Field(0.02, gt=0)
    scaled_init: bool = Field(True, description="output projections get std / sqrt(2 layers)")

    @model_validator(mode="after")
    def _check_gate(self) -> GMLPConfig:
        if self.gate_size % self.gate_heads:
            raise ValueError(
                f"gate_size={self.gate_size} is not divisible by gate_heads={self.gate_heads}"
            )
        return self

    def check_layout(self, spec) -> None:
        if spec.cp > 1 or spec.ep > 1:
            raise LayoutError(
                f"the gmlp model splits over tp, pp, vpp, dp and sequence_parallel only "
                f"(got cp={spec.cp}, ep={spec.ep})"
            )
        spec.check_model(vocab_size=self.vocab_size, seq_len=self.seq_len)
        for name in ("gate_heads", "gate_size"):
            if getattr(self, name) % spec.tp:
                raise LayoutError(f"{name}={getattr(self, name)} is not divisible by tp={spec.tp}")
        if self.num_layers % (spec.pp * spec.vpp):
            raise LayoutError(
                f"{self.num_layers} layers are not divisible by pp*vpp = {spec.pp}*{spec.vpp} "
                "pipeline chunks"
            )

    def num_params(self, active: bool = False) -> int:
        h, g, v, s = self.hidden_size, self.gate_size, self.vocab_size or 0, self.seq_len
        norm = h * (2 if self.norm == "layernorm" else 1)
        block = norm + 3 * g * h + self.gate_heads * (s * s + s)
        if self.bias:
            block += 2 * g + h
        return v * h + self.num_layers * block + norm + h * v

    def flops_per_step(self, global_batch: int) -> float:
        """6 FLOPs per token and matmul weight (forward + backward), plus the token
        mixing: each of ``gate_size`` channels sums over ``seq_len`` positions (the
        masked upper triangle included, as the dense einsum computes it)."""
        h, g, s, layers = self.hidden_size, self.gate_size, self.seq_len, self.num_layers
        weights = layers * 3 * g * h + h * (self.vocab_size or 0)
        return 6.0 * global_batch * s * (weights + layers * s * g)

    def describe(self) -> str:
        return (
            f"gMLP (causal) {self.num_params() / 1e6:.2f}M params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, gate {self.gate_size} in {self.gate_heads} heads, "
            f"vocab {self.vocab_size}, seq {self.seq_len}"
        )

    def structure(self) -> dict[str, Any]:
        names = ("family", "vocab_size", "hidden_size", "num_layers", "gate_size", "gate_heads",
                 "seq_len", "norm", "bias")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def numerics(self) -> dict[str, Any]:
        return {"norm_eps": self.norm_eps, "dropout": self.dropout}


class GMLPFamily(ModelFamily):
    name = "gmlp"
    config = GMLPConfig
    capabilities = Capabilities(generates=True)
    description = "causal gMLP language model: token mixing by spatial gating, no attention"

    def build_chunks(self, config: GMLPConfig, layout, backend, seed: int = 0, fp8=None):
        from mtcore_example_family.model import build

        return build(config, layout, backend, seed, fp8)

    def one_process(self, config: GMLPConfig, backend=None):
        from mtcore_example_family.model import GMLP

        return GMLP(config, backend=backend)

    def messages(self, config: GMLPConfig, layout, micro_batch_size: int, dtype: torch.dtype):
        """The hidden states cross every boundary: a sequence shard under sequence parallel."""
        sp = layout.spec.sequence_parallel and layout.tp > 1
        seq = config.seq_len // layout.tp if sp else config.seq_len
        spec = {"hidden": TensorSpec((micro_batch_size, seq, config.hidden_size), dtype)}
        return lambda boundary: spec

    def loss_counts(self, config: GMLPConfig, batch) -> dict[str, torch.Tensor]:
        return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}

    def metric_names(self, config: GMLPConfig) -> tuple[str, ...]:
        return ("accuracy",)

    def data(self, data_config, model_config: GMLPConfig) -> FamilyData:
        """Packed next-token batches from mtcore's shared data pipeline."""
        from mtcore.data import LMLoader, build_datasets

        datasets = build_datasets(data_config)
        return FamilyData(datasets.tokenizer, datasets.train, datasets.valid, LMLoader)

    def generate(self, model, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
                 temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
        """The prompt and its continuation: greedy, or top-k sampling with ``generator``."""
        from mtcore.models.common.sampling import continue_tokens

        ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
        tokens = torch.tensor([ids], device=next(model.parameters()).device)
        out = continue_tokens(model, tokens, max_new_tokens, model.config.seq_len, top_k,
                              temperature, generator)  # fmt: skip
        return tokenizer.decode(out[0].tolist())


FAMILY = GMLPFamily()
