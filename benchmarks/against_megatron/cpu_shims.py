"""What Megatron-Core 0.16.1 needs to run on CPU ranks; none changes its arithmetic.

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")`` (Megatron passes it
   as the ``device=`` of its buffers); ``use_cpu_initialization=True`` builds the weights.
2. ``CudaRNGStatesTracker.fork`` is a no-op context (it swaps CUDA RNG states;
   dropout is 0 here, so no random number is drawn inside it).
3. An explicit attention mask is passed (causal ``[1, 1, s, s]`` for GPT and T5's
   decoder): with ``None`` Megatron builds its default mask on ``device="cuda"``.
4. Fusions off (``masked_softmax_fusion``, ``bias_activation_fusion``,
   ``bias_dropout_fusion``, ``gradient_accumulation_fusion``, ``apply_rope_fusion``,
   ``persist_layer_norm``): each needs Apex, Transformer Engine or CUDA extensions.
5. ``tp2-sp`` only: the local spec's ``WrappedTorchNorm`` refuses sequence parallel
   (it needs Apex's ``FusedLayerNorm``), so the norms are ``SequenceParallelNorm``
   below, with their gradients summed over tp after backward, as Megatron's
   ``finalize_model_grads`` does for such parameters.
6. The pipeline schedules allocate their token counter with ``device="cuda"``
   (``schedules.py``), the fp32 optimizer wrapper its loss scale of 1
   (``optimizer.py``, ``FP32Optimizer``) and the gradient norm its overflow flag and
   result (``clip_grads.py``, ``utils.local_multi_tensor_l2_norm``): those modules see a ``torch`` whose
   ``zeros`` and ``tensor`` put a "cuda" tensor on the CPU (``_CpuTorch``);
   ``torch.cuda.synchronize`` is a no-op (the
   p2p code calls it); ``batch_p2p_comm=False`` sends stage to stage with plain
   ``isend``/``irecv`` pairs, which gloo runs.
7. ``Tensor.cuda()`` is the tensor itself: a tied output layer on the last pipeline
   stage is moved "to the GPU" before its all-reduce with the first stage's embedding.
8. The MoE all-to-all dispatcher copies its split sizes to the host on a side CUDA
   stream (``token_dispatcher.py``): that module's ``torch.cuda.Stream``,
   ``current_stream`` and ``stream`` are a stream that has nothing to wait for
   (``_HostStream``; CPU work is synchronous); its copy to the host
   (``maybe_move_tensor_to_cpu``) turns split sizes into numpy arrays only for a CUDA
   tensor, so on the CPU it is ``_split_sizes_on_host``, which does that for any
   tensor (``all_to_all_single`` refuses tensors as split sizes); and ``moe_utils`` allocates its
   aux-loss log with ``device="cuda"`` (change 6's ``torch``).
9. ``moe_utils.te_general_gemm`` is None (0.16.1 leaves it undefined without
   Transformer Engine and the router's linear fails with a NameError).
"""

from __future__ import annotations

import contextlib
import types

import torch


class _HostStream:
    """A CUDA stream and its events on the CPU, where work is synchronous: nothing to
    wait for (change 8)."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _HostStreams(types.ModuleType):
    """``torch.cuda`` with ``Stream``, ``current_stream`` and ``stream`` on the host."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    Stream = staticmethod(lambda *a, **k: _HOST_STREAM)
    current_stream = staticmethod(lambda *a, **k: _HOST_STREAM)
    stream = staticmethod(lambda s=None: contextlib.nullcontext())


def _split_sizes_on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU (change 8)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _CpuTorch(types.ModuleType):
    """``torch`` for a Megatron module, whose ``zeros`` and ``tensor`` with
    ``device="cuda"`` are on the CPU (change 6)."""

    def __init__(self):
        super().__init__("torch")

    cuda = _HostStreams()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        return torch.zeros(*args, **_on_cpu(kwargs))

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **_on_cpu(kwargs))


def _on_cpu(kwargs: dict) -> dict:
    return {**kwargs, "device": "cpu"} if kwargs.get("device") == "cuda" else kwargs


def megatron_on_cpu() -> None:
    """Changes 1, 2 and 6-9 (3-5 are in how the sides build and call the models)."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    cpu_torch = _CpuTorch()
    for module in (schedules, optimizer, clip_grads, utils, token_dispatcher, moe_utils):
        module.torch = cpu_torch
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_host
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class SequenceParallelNorm(torch.nn.LayerNorm):
    """Change 5: a LayerNorm for Megatron's spec that sequence parallel accepts."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True
