"""Megatron-Core's GPT: its ``TransformerConfig`` from the shared shapes, ``GPTModel``
with ``get_gpt_layer_local_spec`` (its pure-PyTorch modules; MoE through
``num_experts=...``, ``moe_grouped_gemm=False``: its ``SequentialMLP`` experts), and the
plain step of the first four configurations (``LegacyGPTSide``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .configs import (
    BATCH,
    BETAS,
    EPS,
    HEADS,
    HIDDEN,
    LAYERS,
    LLAMA_KV_HEADS,
    LR,
    SEQ,
    TOP_K,
    VOCAB,
    BenchConfig,
)
from .cpu_shims import SequenceParallelNorm
from .mtcore_side import ffn_size

CAUSAL = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # cpu_shims 3


def transformer_config(cfg: BenchConfig, **fields):
    """GPT-2 style (LayerNorm, tanh-GELU, biases) or Llama style (RMSNorm, SwiGLU, no
    biases, 4 kv heads), fusions off (cpu_shims 4), dropout 0, fp32."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = cfg.style == "llama"
    moe = {}
    if cfg.experts:
        moe = dict(
            num_moe_experts=cfg.experts, moe_router_topk=TOP_K, moe_ffn_hidden_size=ffn_size(cfg),
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
            moe_permute_fusion=False, expert_model_parallel_size=cfg.ep,
        )  # fmt: skip
    base = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=LLAMA_KV_HEADS if llama else None, ffn_hidden_size=ffn_size(cfg),
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        sequence_parallel=cfg.sp, normalization="RMSNorm" if llama else "LayerNorm",
        gated_linear_unit=llama,
        activation_func=F.silu if llama else functools.partial(F.gelu, approximate="tanh"),
        add_bias_linear=not llama, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, batch_p2p_comm=False, **moe,
    )  # fmt: skip
    return TransformerConfig(**{**base, **fields})


def build_gpt(cfg: BenchConfig):
    """This rank's pipeline stage of the GPT (tied output at gpt2 style)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    llama = cfg.style == "llama"
    norm = "RMSNorm" if llama else "LayerNorm"
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.experts or None, moe_grouped_gemm=False, normalization=norm
    )
    if cfg.sp:  # cpu_shims 5
        spec.submodules.input_layernorm = SequenceParallelNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
        spec = TransformerBlockSubmodules([spec] * LAYERS, layer_norm=SequenceParallelNorm)
    return GPTModel(
        transformer_config(cfg), spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope" if llama else "learned_absolute",
        share_embeddings_and_output_weights=not llama,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )  # fmt: skip


def gpt_forward(model, batch: dict):
    """Per-token losses ``[b, s]`` on the last stage, the hidden states elsewhere."""
    tokens = batch["tokens"]
    positions = torch.arange(SEQ)[None].expand(tokens.shape[0], SEQ)
    return model(tokens, positions, CAUSAL, labels=batch["labels"])


class LegacyGPTSide:
    """tp1, tp2, tp2-sp, llama-tp2: the model in a plain loop, ``torch.optim.AdamW``
    over its parameters, no DDP (dp = pp = 1), one micro-batch (as measured since
    session 1; ``megatron_training`` runs the other configurations)."""

    def __init__(self, cfg: BenchConfig):
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.model = build_gpt(cfg)
        self.sp_params = [
            p for p in self.model.parameters() if getattr(p, "sequence_parallel", False)
        ]
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0
        )
        assert cfg.micro_batch == BATCH

    def step(self, micro_batches: list[dict]) -> float:
        import torch.distributed as dist

        (batch,) = micro_batches
        self.opt.zero_grad(set_to_none=True)
        loss = gpt_forward(self.model, batch).mean()
        loss.backward()
        if self.sp_params:  # cpu_shims 5: as finalize_model_grads, one flat all-reduce
            grads = [p.grad for p in self.sp_params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.tp_group)
            for g, summed in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                g.copy_(summed)
        self.opt.step()
        return loss.item()
