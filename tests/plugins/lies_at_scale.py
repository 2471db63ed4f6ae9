"""Sources of the throwaway distribution ``mtcore-liars-at-scale`` (test_lies_at_scale.py).

Each lie is right on the small inputs the kit used to send and wrong, or slow, at the
sizes real jobs use:

* ``MaskDropper``: attention that drops the causal mask above 64 queries;
* ``slow_swiglu``: SwiGLU that computes the reference 100 times (100x slower);
* ``saturating_quantize``: FP8 quantize that saturates e4m3 at 240 instead of 448 when
  a scale is given (delayed scaling);
* ``LargeMessageLiar``: a collective whose reduce_scatter returns the unsummed shard
  above 4,096 elements and whose all_gather puts the blocks in reversed rank order
  above 64 KiB (sequence parallelism's gathers);
* ``RoundedScalesFP8``: FP8 whose quantize rounds its scales to bfloat16;
* ``SlowNativeFP8``: FP8 that declares the pairs the host's ``torch._scaled_mm``
  runs native and takes 0.2 s for each of them (300 s a step, in a job);
* ``NoMemoryDevice``: a device whose capabilities say it has 0 bytes of memory.

Backend ``liar_at_scale`` has every lie but the rounded scales (the kit's run);
``liar_scales`` has only those; ``liar_gather``, ``liar_scatter``, ``liar_mask``,
``liar_saturate`` and ``liar_slow`` one lie each (a training job each).
"""

LIARS = """
import dataclasses
import time

import torch

from mtcore.backend import (
    FP8, BackendSpec, Collective, CpuDevice, KernelImpl, cpu_scaled_mm_pairs,
    gloo_capabilities, hookimpl,
)
from mtcore.ops import attention as reference_attention
from mtcore.ops import fp8_quantize as reference_quantize
from mtcore.ops import swiglu as reference_swiglu


def attention_drops_mask_above_64(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):
    # Right for every case of up to 64 queries; above, every query sees the future.
    long = q.shape[-2] > 64
    return reference_attention(q, k, v, causal and not long, key_padding_mask, scale, window,
                               dropout_p, dropout_seeds, query_documents, key_documents)


def slow_swiglu(x):
    for _ in range(99):
        reference_swiglu(x)
    return reference_swiglu(x)


def saturating_quantize(x, dtype, granularity, scale=None):
    data, scale_inv, amax = reference_quantize(x, dtype, granularity, scale)
    if scale is not None and dtype == torch.float8_e4m3fn:
        given = float(scale)
        data = (x.float() * given).clamp(-240.0, 240.0).to(dtype)
    return data, scale_inv, amax


class LargeMessageLiar(Collective):
    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if output.numel() > 4096 and op == "sum" and not async_op:
            shard = self.rank(group)
            output.copy_(input.reshape(self.world_size(group), *output.shape)[shard])
            return None
        return super().reduce_scatter(output, input, op, group, async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        result = super().all_gather(output, input, group, async_op)
        if output.numel() * output.element_size() > 64 * 1024 and not async_op:
            blocks = output.reshape(self.world_size(group), -1)
            output.copy_(blocks.flip(0).reshape(output.shape))
        return result


class HonestGatherLiar(LargeMessageLiar):
    all_gather = Collective.all_gather


class HonestScatterLiar(LargeMessageLiar):
    reduce_scatter = Collective.reduce_scatter


class RoundedScalesFP8(FP8):
    def quantize(self, x, dtype, granularity="tensor", scale=None):
        q = super().quantize(x, dtype, granularity, scale)
        rounded = q.scale_inv.to(torch.bfloat16).float()
        return self.quantized(q.data, rounded, q.amax, granularity)


class SlowNativeFP8(FP8):
    def scaled_matmul(self, a, b, out_dtype=torch.float32):
        if self.takes_natively(a, b):
            time.sleep(0.2)
        return super().scaled_matmul(a, b, out_dtype)


class NoMemoryDevice(CpuDevice):
    def capabilities(self):
        return dataclasses.replace(super().capabilities(), memory_bytes=0)


def _spec(name, device=None, collective=None, fp8=None):
    return BackendSpec(
        name=name,
        device=device or CpuDevice(),
        collective=collective or Collective("gloo", gloo_capabilities()),
        fp8=fp8 or FP8(),
        accelerator=False,
    )


@hookimpl
def mtcore_backends():
    gloo = gloo_capabilities()
    return [
        _spec("liar_at_scale", NoMemoryDevice(), LargeMessageLiar("gloo", gloo),
              SlowNativeFP8(native_granularities=cpu_scaled_mm_pairs)),
        _spec("liar_scales", fp8=RoundedScalesFP8()),
        _spec("liar_gather", collective=HonestScatterLiar("gloo", gloo)),
        _spec("liar_scatter", collective=HonestGatherLiar("gloo", gloo)),
        _spec("liar_mask"),
        _spec("liar_saturate"),
        _spec("liar_slow"),
    ]


def _fp32(query):
    return query.dtype == torch.float32


def _kernels():  # fresh each time: the registry fills in each implementation's plugin
    return {
    "mask": KernelImpl("attention", attention_drops_mask_above_64, "drops-mask-above-64",
                       priority=60, predicate=_fp32),
    "slow": KernelImpl("swiglu", slow_swiglu, "hundred-times-slower", priority=60,
                       predicate=_fp32),
    "saturate": KernelImpl("fp8_quantize", saturating_quantize, "saturates-at-240",
                           priority=60, predicate=_fp32),
    }


BACKEND_KERNELS = {
    "liar_at_scale": ("mask", "slow", "saturate"),
    "liar_mask": ("mask",),
    "liar_slow": ("slow",),
    "liar_saturate": ("saturate",),
}


@hookimpl
def mtcore_kernels(backend, device_type):
    kernels = _kernels()
    return [kernels[name] for name in BACKEND_KERNELS.get(backend, ())]
"""
