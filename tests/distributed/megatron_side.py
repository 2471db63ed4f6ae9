"""Megatron-Core 0.16.1 on CPU ranks with gloo, for the checkpoint interop tests: build
a tiny ``GPTModel`` (its pure-PyTorch local spec), run tokens through its pipeline
stages to full logits, save it as Megatron-LM does (torch_dist and legacy per-rank
files) and load a legacy checkpoint back.

What Megatron-Core needs to run here (none changes its arithmetic; the benchmark
``benchmarks/bench_megatron.py`` makes these and more changes of its own, listed in
``benchmarks/against_megatron/cpu_shims.py``):

1. ``torch.cuda.current_device`` answers the CPU (Megatron passes it as ``device=``);
   ``use_cpu_initialization=True`` builds the weights.
2. ``CudaRNGStatesTracker.fork`` is a no-op context (dropout is 0: nothing is drawn).
3. ``torch.cuda.synchronize`` is a no-op (dist_checkpointing's save calls it), and
   ``Tensor.cuda()`` is the tensor itself (a tied output layer on the last pipeline
   stage is moved there before its all-reduce with the embedding).
4. dist_checkpointing's writer forks a process per file and collects their results
   through a queue made by a spawned ``multiprocessing.Manager``: the rank (a daemon
   process of ``run_ranks``, which may not have children) is marked non-daemonic for
   the save, and the queue is a ``queue.Queue``: the synchronous save fills and reads
   it in the rank's own process (a multiprocessing queue's put lands later, through
   its feeder thread, and the read right after it can find it empty).
5. ``moe_utils.te_general_gemm`` is None (0.16.1 leaves it undefined without Transformer
   Engine, and the router's linear fails with a NameError).
6. An explicit causal ``attention_mask`` (Megatron's default is built on "cuda").

Kept apart from the test module, so the ranks import no pytest fixtures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import queue
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def megatron_on_cpu() -> None:
    """Changes 1-3, 4's queue and 5."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    filesystem_async._results_queue = queue.Queue()


def build(case: dict, seed: int):
    """This rank's stage of a ``GPTModel`` for ``case`` (Megatron-LM argument names),
    with random norms and biases (so that a mix-up of them shows in the logits)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu, experts = case["swiglu"], case.get("num_experts")
    gelu = functools.partial(F.gelu, approximate="tanh") if case.get("openai_gelu") else F.gelu
    norm = case["normalization"]
    config = TransformerConfig(
        num_layers=case["num_layers"], hidden_size=case["hidden_size"],
        num_attention_heads=case["num_attention_heads"],
        num_query_groups=case.get("num_query_groups"), ffn_hidden_size=case["ffn_hidden_size"],
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        init_method_std=0.05, hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_epsilon=case.get("norm_epsilon", 1e-5),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        normalization=norm, gated_linear_unit=swiglu, activation_func=F.silu if swiglu else gelu,
        add_bias_linear=case["add_bias_linear"], num_moe_experts=experts,
        moe_router_topk=case.get("moe_router_topk", 2), moe_ffn_hidden_size=case.get("moe_ffn_hidden_size"),
        moe_token_dispatcher_type="allgather", masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
    )  # fmt: skip
    stage = parallel_state.get_pipeline_model_parallel_rank()
    last = stage == parallel_state.get_pipeline_model_parallel_world_size() - 1
    torch.manual_seed(seed + stage)
    model = GPTModel(
        config, get_gpt_layer_local_spec(num_experts=experts, normalization=norm),
        vocab_size=case["padded_vocab_size"], max_sequence_length=case["max_position_embeddings"],
        position_embedding_type=case["position_embedding_type"],
        share_embeddings_and_output_weights=not case["untie_embeddings_and_output_weights"],
        pre_process=stage == 0, post_process=last,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # the same on every tp rank
                g = torch.Generator().manual_seed(seed + len(name) * 7919 + stage)
                param.copy_(0.2 * torch.randn(param.shape, generator=g) + ("norm" in name))
    return model.eval()


def forward_logits(model, tokens: torch.Tensor):
    """The full ``[b, s, vocab]`` logits on the last stage (gathered over tp), None
    elsewhere; hidden states go stage to stage with blocking send/recv."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # change 6
    positions = torch.arange(s)[None].expand(b, s)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens if ps.is_pipeline_first_stage() else None, positions, mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def save_both(model, case: dict, root: Path, iteration: int) -> None:
    """Save as Megatron-LM does: ``root/torch_dist`` (``dist_checkpointing.save`` of the
    model's sharded state dict, the arguments in common.pt) and ``root/legacy``
    (``iter_N/mp_rank_TT_PPP/model_optim_rng.pt``, with numpy RNG state beside)."""
    import numpy as np
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    args = argparse.Namespace(**case, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                              pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                              expert_model_parallel_size=ps.get_expert_model_parallel_world_size())  # fmt: skip
    directory = root / "torch_dist" / f"iter_{iteration:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    multiprocessing.current_process()._config["daemon"] = False  # change 4
    state = {"args": args, "iteration": iteration, "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, str(directory))
    legacy = root / "legacy" / f"iter_{iteration:07d}" / rank_directory()
    legacy.mkdir(parents=True, exist_ok=True)
    rng = {"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
    saved = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.state_dict_for_save_checkpoint(), "rng_state": [rng]}  # fmt: skip
    torch.save(saved, legacy / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        for kind in ("torch_dist", "legacy"):
            (root / kind / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def load_legacy(model, root: Path) -> None:
    """Load this rank's ``model_optim_rng.pt`` of a legacy checkpoint (strict)."""
    iteration = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    path = root / f"iter_{int(iteration):07d}" / rank_directory() / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"], strict=True)


def rank_directory() -> str:
    """Megatron-LM's name for this rank's directory: ``mp_rank_TT``, ``_PPP`` with
    pipeline parallelism, ``_EEE`` with expert parallelism."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name
