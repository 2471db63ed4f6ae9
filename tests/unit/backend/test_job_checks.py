"""The self-check's job-sized parts: FP8 with its scales, collectives on the job's groups
at large and odd sizes, and the timing against the reference (issue 48, section 3)."""

from __future__ import annotations

import time

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.backend.checks import kernel_timing
from mtcore.backend.checks.job_collectives import GroupUse, check_collectives, large_size
from mtcore.backend.checks.job_fp8 import FP8Gemm, check_fp8
from mtcore.backend.fp8 import FP8
from mtcore.ops import REFERENCE_OPS
from mtcore.testing.distributed import run_ranks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCKWISE = [
    FP8Gemm("forward", (E4M3, "1x128"), (E4M3, "128x128")),
    FP8Gemm("dgrad", (E5M2, "1x128"), (E4M3, "128x128")),
    FP8Gemm("wgrad", (E5M2, "1x128"), (E4M3, "1x128")),
]
TENSORWISE = [FP8Gemm("forward", (E4M3, "tensor"), (E4M3, "tensor"))]


class RoundedScales(FP8):
    def quantize(self, x, dtype, granularity="tensor", scale=None):
        q = super().quantize(x, dtype, granularity, scale)
        return self.quantized(q.data, q.scale_inv.to(torch.bfloat16).float(), q.amax, granularity)


class IgnoresScalesWhenNarrowing(FP8):
    def scaled_matmul(self, a, b, out_dtype=torch.float32):
        if out_dtype == torch.float32:
            return super().scaled_matmul(a, b, out_dtype)
        return (a.values() @ b.values().t()).to(out_dtype)


def test_fp8_check_passes_the_host_backend_and_fails_rounded_or_dropped_scales():
    fp8 = select_backend("cpu").fp8
    both = (torch.bfloat16, torch.float32)
    assert check_fp8(fp8, BLOCKWISE, both, False, "cpu") == []
    assert check_fp8(fp8, TENSORWISE, both, True, "cpu") == []  # delayed: at the max too
    rounded = check_fp8(RoundedScales(), TENSORWISE, both, True, "cpu")
    assert rounded and "scale_inv off the reference's" in rounded[0], rounded
    dropped = check_fp8(IgnoresScalesWhenNarrowing(), TENSORWISE, both, False, "cpu")
    assert len(dropped) == 1 and "into bfloat16: relative error" in dropped[0], dropped


def test_a_kernel_far_slower_than_the_reference_fails_and_the_reference_passes():
    x = torch.randn(64, 512)

    def slow(x):
        time.sleep(0.002)  # a small op made 50-100x slower
        return REFERENCE_OPS["swiglu"](x)

    def inputs():
        return (x.clone(),), {}

    kernel_timing.check_speed("swiglu", REFERENCE_OPS["swiglu"], None, inputs, lambda: None)
    with pytest.raises(AssertionError, match="slow enough to make a job crawl"):
        kernel_timing.check_speed("swiglu", slow, None, inputs, lambda: None)


def _collectives_on_the_jobs_groups(ctx, lie: str):
    """Rank body: the world and a latency-bound (tensor-parallel) group, honest or lying."""
    collective = ctx.backend.collective
    if lie:
        honest = type(collective)

        def reversed_large_gather(self, output, input, group=None, async_op=False):
            honest.all_gather(self, output, input, group, async_op)
            if output.numel() * output.element_size() > 64 << 10:
                output.copy_(output.reshape(self.world_size(group), -1).flip(0).flatten())

        collective.__class__ = type("Liar", (honest,), {"all_gather": reversed_large_gather})
    tp = collective.new_group(list(range(ctx.world_size)), latency_bound=True)
    ops = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
    uses = [
        GroupUse("world", None, ops, 0, torch.float32),
        GroupUse("tp", tp, ops, 70_001, torch.bfloat16),
    ]
    start = time.perf_counter()
    problems = check_collectives(collective, uses, ctx.backend.torch_device())
    return problems, time.perf_counter() - start


def test_collectives_on_the_jobs_groups_and_a_reversed_large_all_gather():
    assert large_size(10) == 16_385 and large_size(70_000) == 70_001 and large_size(1 << 40) % 2
    honest = run_ranks(_collectives_on_the_jobs_groups, 2, "", timeout_s=120)
    assert all(problems == [] for problems, _ in honest), honest
    assert max(seconds for _, seconds in honest) < 2.0, honest  # the budget, on 2 busy cores
    lying = run_ranks(_collectives_on_the_jobs_groups, 2, "reverse", timeout_s=120)
    for problems, _ in lying:
        # Small gathers are right; both large ones (world and tp, 16385 and 70001) are not.
        assert [p.split(":")[0] for p in problems] == [
            "all_gather (rank order) of 16385 float32 on world (size 2)",
            "all_gather (rank order) of 70001 bfloat16 on tp (size 2)",
        ], problems
