"""The Triton kernel pack against the reference ops, on CPU under TRITON_INTERPRET=1.

Two layers of checks. The conformance kit's cases and tolerances (what any
backend must pass; odd sizes, masked rows, ignored targets) run on every kernel
directly. Stricter checks on extra shapes chosen to cross the kernels' block
boundaries (one row, hidden sizes that are not powers of two, more rows than a
backward block, vocabularies longer than one block) compare against:

* float32: the reference in float64 on the same inputs. The kernels compute in
  float32 and differ from the exact result by float32 rounding and their own
  reduction order: a few ulp (1.2e-7 each) per element, plus cancellation in
  gradients where terms of size max|ref| cancel, hence
  ``|got - ref| <= 1e-5 * |ref| + 1e-6 * max|ref|``.
* bfloat16: the reference on the same bf16 inputs, which computes in float32 and
  rounds once. The kernels do the same, so the float32 values before rounding
  differ only by reduction order (~1e-6 relative) and the rounded results by at
  most one bf16 ulp (2**-7 relative, 2**-8 for the result's binade, but one
  bound serves): ``|got - ref| <= 2**-7 * |ref| + 1e-3 * max|ref|``; the
  absolute term covers gradient elements near zero produced by cancellation,
  where 1e-6 of max|ref| before rounding is more than an ulp of the element.
"""

from __future__ import annotations

import pytest
import torch

# triton.language, not triton: a namespace package named triton (a folder) must not pass.
pytest.importorskip("triton.language")
pytest.importorskip("mtcore_triton")

from mtcore import ops
from mtcore.backend.checks import kernel_cases as kit
from mtcore.ops import rope_tables
from mtcore_triton import (
    adamw,
    cross_entropy,
    fp8,
    launch,
    norms,
    pointwise,
    registration,
)

pytestmark = pytest.mark.triton_interpreter

DTYPES = (torch.float32, torch.bfloat16)
TOL = {
    torch.float32: kit.Tolerance(rtol=1e-5, atol=1e-6),
    torch.bfloat16: kit.Tolerance(rtol=2.0**-7, atol=1e-3),
    torch.float16: kit.Tolerance(rtol=2.0**-10, atol=1e-3),  # same argument, 10-bit mantissa
}
TRITON_OPS = {
    "rms_norm": norms.rms_norm,
    "layer_norm": norms.layer_norm,
    "rope": pointwise.rope,
    "swiglu": pointwise.swiglu,
    "cross_entropy": cross_entropy.cross_entropy,
}


def _randn(seed, *shape, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale + shift


def test_runs_in_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (
        norms._norm_fwd,
        pointwise._rope,
        cross_entropy._ce_fwd,
        adamw._adamw_multi,
        fp8._quantize,
    ):
        assert isinstance(kernel, InterpretedFunction), (
            f"{kernel} is compiled, not interpreted: TRITON_INTERPRET was set too late"
        )


def _record_num_warps(monkeypatch, kernel) -> list[int]:
    """The num_warps of each launch of ``kernel``; the launch itself still runs."""
    seen: list[int] = []
    run = kernel.run

    def recording_run(*args, **kwargs):
        seen.append(kwargs["num_warps"])
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", recording_run)
    return seen


@pytest.mark.parametrize("warp", [32, 128], ids=lambda w: f"warp{w}")
def test_launches_take_num_warps_from_the_target_warp_size(monkeypatch, warp):
    # The interpreter has no target (32 is assumed); a MUSA arch < 3.1 target reports
    # 128. The same threads per program, so a quarter of the warps at 128; the
    # interpreter ignores num_warps, so the results stay the reference's.
    assert launch.warp_size() == launch.INTERPRETER_WARP_SIZE == 32
    monkeypatch.setattr(launch, "warp_size", lambda: warp)
    norm = _record_num_warps(monkeypatch, norms._norm_fwd)
    glu = _record_num_warps(monkeypatch, pointwise._swiglu_fwd)
    tile = _record_num_warps(monkeypatch, fp8._quantize)
    x, w = _randn(1, 3, 4096), _randn(2, 4096)
    kit.compare(
        norms.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), "rms_norm", TOL[torch.float32]
    )
    kit.compare(pointwise.swiglu(x), ops.swiglu(x), "swiglu", TOL[torch.float32])
    (data, _, _) = fp8.fp8_quantize(x, torch.float8_e4m3fn, "tensor")
    (want, _, _) = ops.fp8_quantize(x, torch.float8_e4m3fn, "tensor")
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    # 512 threads per 4096-wide norm row, 128 per swiglu block, 256 per FP8 tile.
    assert (norm, glu, tile) == ([512 // warp], [128 // warp], [256 // warp])


# cross_entropy's cases take the longest under the interpreter; its odd-shape tests below
# stay in the default suite.
@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize(
    "op",
    [pytest.param(op, marks=pytest.mark.extended) if op == "cross_entropy" else op
     for op in TRITON_OPS],
)  # fmt: skip
def test_conformance_cases(op, dtype):
    ran = kit.check_op(op, TRITON_OPS[op], None, dtype, "cpu")
    assert len(ran) == len(kit.CASES[op]())


def _check(op, fn, inputs, dtype, grads=True):
    """Forward and backward of ``fn`` vs ``ops.<op>``; ``inputs``: (tensor, requires_grad)."""
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    mine = [
        t.detach().to(dtype, copy=True).requires_grad_(g)
        if isinstance(t, torch.Tensor) and g
        else t
        for t, g in inputs
    ]
    theirs = [
        t.detach().to(dtype).to(ref_dtype, copy=True).requires_grad_(g)
        if isinstance(t, torch.Tensor) and g
        else t
        for t, g in inputs
    ]
    out = fn(*mine)
    want = getattr(ops, op)(*theirs)
    assert out.dtype == (torch.float32 if op == "cross_entropy" else dtype)
    kit.compare(out, want, f"{op} forward", TOL[dtype])
    if not grads:
        return
    grad = _randn(7, *out.shape).to(out.dtype)
    out.backward(grad)
    want.backward(grad.to(want.dtype))
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad.dtype == a.dtype
            kit.compare(a.grad, b.grad, f"{op} grad of input {i}", TOL[dtype])


# Shapes cross the block boundaries: norms' 16-row backward blocks (37 rows),
# non-power-of-two hidden sizes, one row; swiglu's 1024-column blocks; cross
# entropy's 1024-wide vocabulary chunks.
@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("shape", [(1, 3), (37, 100), (2, 3, 257)], ids=str)
def test_norms_odd_shapes(shape, dtype):
    x, w, b = _randn(1, *shape), _randn(2, shape[-1], shift=1.0), _randn(3, shape[-1])
    _check("rms_norm", norms.rms_norm, [(x, True), (w, True), (1e-5, False)], dtype)
    _check("layer_norm", norms.layer_norm, [(x, True), (w, True), (b, True), (1e-5, False)], dtype)
    _check(
        "layer_norm", norms.layer_norm, [(x, True), (w, True), (None, False), (0.1, False)], dtype
    )


def test_norms_float32_weight_with_bf16_input():
    x = _randn(4, 5, 48).bfloat16().requires_grad_()
    w = _randn(5, 48).requires_grad_()
    y = norms.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    y.sum().backward()
    assert w.grad.dtype == torch.float32
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ops.rms_norm(xr, wr, 1e-6).sum().backward()
    kit.compare(y, ops.rms_norm(xr, wr, 1e-6), "forward", TOL[torch.bfloat16])
    kit.compare(w.grad, wr.grad, "weight grad", kit.Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("bshd", [(1, 1, 1, 2), (2, 5, 3, 6), (1, 9, 7, 40)], ids=str)
def test_rope_odd_shapes(bshd, dtype):
    b, s, h, d = bshd
    cos, sin = rope_tables(s, d, offset=3)
    _check(
        "rope", pointwise.rope, [(_randn(8, b, s, h, d), True), (cos, False), (sin, False)], dtype
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2, 98), (2, 2 * 1100)], ids=str)
def test_swiglu_odd_shapes(shape, dtype):
    _check("swiglu", pointwise.swiglu, [(_randn(9, *shape, scale=2.0), True)], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("nv", [(1, 1), (6, 2500)], ids=str)
def test_cross_entropy_odd_shapes(nv, dtype):
    n, v = nv
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    _check(
        "cross_entropy",
        cross_entropy.cross_entropy,
        [(_randn(10, n, v, scale=3.0), True), (target, False)],
        dtype,
    )


def test_cross_entropy_ignore_index_like_reference():
    # Ignored rows: loss exactly 0 and an exactly zero gradient row, also when the
    # ignore value is a valid class (7) or every row is ignored.
    logits = _randn(11, 5, 300).requires_grad_()
    target = torch.tensor([7, 3, 7, 299, 0])
    loss = cross_entropy.cross_entropy(logits, target, 7)
    loss.backward(torch.ones(5))
    assert loss[0].item() == 0.0 and loss[2].item() == 0.0 and (loss[[1, 3, 4]] > 0).all()
    assert (logits.grad[[0, 2]] == 0).all() and (logits.grad[[1, 3, 4]] != 0).any(dim=1).all()
    kit.compare(loss, ops.cross_entropy(logits.detach(), target, 7), "loss", TOL[torch.float32])
    all_ignored = cross_entropy.cross_entropy(logits.detach(), torch.full((5,), -100), -100)
    assert torch.equal(all_ignored, torch.zeros(5))


@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
def test_adamw_conformance(dtype):
    assert kit.check_adamw(adamw.adamw_step, registration.adamw_ok, dtype, "cpu")


def test_adamw_float32_state_matches_reference_to_rounding():
    # Same float32 operation order as the reference, but torch's vectorised CPU
    # kernels fuse or regroup some products (addcdiv's vector path is not its scalar
    # path), so an intermediate may differ in its last bit: one float32 ulp of the
    # largest term (|p| ~ max|p|), which near a zero crossing of p is more than an
    # ulp of the result. Hence rtol 3e-7 plus 1.2e-7 of max|ref|.
    shapes = [(1,), (1000,), (3, 700)]
    hyper = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05}
    mine = [[_randn(20 + i, *s) for i, s in enumerate(shapes)]]
    mine += [[], [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]]
    ref = [[t.clone() for t in lst] for lst in mine]
    for step in range(1, 4):
        grads = [_randn(40 * step + i, *s) for i, s in enumerate(shapes)]
        mine[1], ref[1] = grads, grads
        adamw.adamw_step(*mine, step=step, **hyper)
        ops.adamw_step(*ref, step=step, **hyper)
    for k in (0, 2, 3):
        for got, want in zip(mine[k], ref[k], strict=True):
            kit.compare(got, want, f"list {k}", kit.Tolerance(rtol=3e-7, atol=1.2e-7))


def test_adamw_one_call_mixed_dtypes_lengths_and_empty_tensors():
    # Tensors group by (param, grad) dtype, one launch each; lengths cross the
    # 1024-element blocks; an empty tensor is skipped.
    ps = [_randn(1, 3000), _randn(2, 5).bfloat16(), torch.zeros(0), _randn(3, 2500)]
    gs = [_randn(4, 3000).bfloat16(), _randn(5, 5).bfloat16(), torch.zeros(0), _randn(6, 2500)]
    mine = [ps, gs, [torch.zeros(p.shape) for p in ps], [torch.zeros(p.shape) for p in ps]]
    ref = [[t.clone() for t in lst] for lst in mine]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
    for step in (1, 2):
        adamw.adamw_step(*mine, step=step, **hyper)
        ops.adamw_step(*ref, step=step, **hyper)
    for k in (0, 2, 3):
        for got, want in zip(mine[k], ref[k], strict=True):
            assert got.dtype == want.dtype
            if want.numel():  # the float32 ulp bound of the test above
                kit.compare(got.float(), want.float(), f"list {k}", kit.Tolerance(3e-7, 1.2e-7))


# The input dtype only changes the kernels' first load; bf16 (the slower half) is in the slow
# run. The exact quantize-transpose tests below stay in the default suite.
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=pytest.mark.extended),
        pytest.param(torch.bfloat16, marks=pytest.mark.slow),
    ],
    ids=kit.dtype_name,
)
def test_fp8_quantize_conformance(dtype):
    assert kit.check_fp8_quantize(fp8.fp8_quantize, None, dtype, "cpu")
    assert kit.check_fp8_quantize_transpose(fp8.fp8_quantize_transpose, None, dtype, "cpu")


@pytest.mark.parametrize("granularity", ["tensor", "row", "1x128", "128x128"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_quantize_transpose_is_exact(fmt, granularity):
    # The kernels round in float32 arithmetic to nearest even, subnormals included,
    # so data equals the reference bit for bit (the kit allows rare one-step misses).
    x = _randn(30, 131, 200, scale=2.0)
    x[0, :50] *= 1e-5  # far below amax: subnormal FP8 values
    x[5] = 0.0
    (d, s, a), (dt, st, at) = fp8.fp8_quantize_transpose(x, fmt, granularity)
    (rd, rs, ra), (rdt, rst, rat) = ops.fp8_quantize_transpose(x, fmt, granularity)
    for got, want in ((d, rd), (s, rs), (a, ra), (dt, rdt), (st, rst), (at, rat)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(
            got.view(torch.uint8) if got.dtype == fmt else got,
            want.view(torch.uint8) if want.dtype == fmt else want,
        )
    if granularity in ("tensor", "128x128"):
        assert torch.equal(st, s.t()) and torch.equal(dt.float(), d.float().t())


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=kit.dtype_name
)
def test_larger_sweep(dtype):
    for i, shape in enumerate([(300, 1000), (4, 4097)]):
        x, w, b = _randn(50 + i, *shape), _randn(60 + i, shape[-1]), _randn(70 + i, shape[-1])
        _check("rms_norm", norms.rms_norm, [(x, True), (w, True), (1e-6, False)], dtype)
        _check(
            "layer_norm", norms.layer_norm, [(x, True), (w, True), (b, True), (1e-5, False)], dtype
        )
    _check("swiglu", pointwise.swiglu, [(_randn(53, 4, 2 * 4097), True)], dtype)
    cos, sin = rope_tables(64, 128, theta=500000.0)
    _check(
        "rope",
        pointwise.rope,
        [(_randn(80, 2, 64, 8, 128), True), (cos, False), (sin, False)],
        dtype,
    )
    target = torch.randint(0, 32000, (16,), generator=torch.Generator().manual_seed(2))
    _check(
        "cross_entropy",
        cross_entropy.cross_entropy,
        [(_randn(81, 16, 32000, scale=4.0), True), (target, False)],
        dtype,
    )
