"""FP8 recipes on the cpu backend: round-trip and GEMM error bounds, delayed-scaling
state, the FP8 linear's gradients, and the layers and config that switch FP8 on.

Round-trip bound. FP8 with m mantissa bits rounds a normal value v in
[2^e, 2^(e+1)) to the nearest multiple of 2^(e-m): |q(v) - v| <= 2^(e-m-1) <= 2^(-m-1) |v|,
so 2^-4 |v| for E4M3 (m=3) and 2^-3 |v| for E5M2 (m=2). Below the smallest normal
the spacing is fixed (2^-9 for E4M3, 2^-16 for E5M2) and the error is at most half
of it. Quantizing x as v = x * scale and recovering q(v) * scale_inv gives, per element,

    |x_hat - x| <= 2^(-m-1) |x| + (subnormal spacing / 2) * scale_inv + 1e-6 |x|

where 1e-6 |x| covers the two fp32 multiplications by scale and scale_inv.

GEMM bound. With the element bounds Ea, Eb of the operands A [M, K], B [N, K]:
|Q(A) Q(B)^T - A B^T| <= |A| Eb^T + Ea |B|^T + Ea Eb^T, plus fp32 accumulation of K
products: K * 2^-24 * (|A| + Ea)(|B| + Eb)^T.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from mtcore.backend import FP8, select_backend
from mtcore.data import lm_batches
from mtcore.ops import fp8_dequantize
from mtcore.precision import MixedPrecision
from mtcore.precision.fp8 import FP8Recipe, FP8Scaling, check_backend_fp8, fp8_linear

BACKEND = select_backend("cpu")
# (relative bound 2^(-m-1), half the subnormal spacing)
BOUNDS = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}
RECIPES = [(f, s) for s in ("delayed", "current", "blockwise") for f in ("e4m3", "hybrid")]


def _wide(shape, seed):
    """Values over ~10 binades, so normals and subnormals of the format both occur."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 2, shape, generator=g))


def _element_bound(x, q, dtype):
    rel, sub = BOUNDS[dtype]
    ones = torch.ones(q.data.shape).to(q.data.dtype)
    scale_inv = fp8_dequantize(ones, q.scale_inv, q.granularity)  # per element
    return (rel + 1e-6) * x.abs() + sub * scale_inv


@pytest.mark.parametrize("fmt,scaling", RECIPES)
def test_round_trip_within_the_format_bound(fmt, scaling):
    recipe = FP8Recipe(fmt, scaling)
    state = FP8Scaling(recipe, BACKEND.fp8)
    for i, role in enumerate(("input", "weight", "grad")):
        x = _wide((200, 300), seed=i)  # not multiples of 128: partial blocks
        state.quantize(x, role)  # delayed: the second call uses the recorded history
        with torch.enable_grad():
            q = state.quantize(x, role)
        dtype = recipe.dtype(role)
        assert q.data.dtype == dtype and q.granularity == recipe.granularity(role)
        err = (q.dequantize() - x).abs()
        bound = _element_bound(x, q, dtype)
        assert (err <= bound).all(), f"{role}: worst excess {(err - bound).max()}"
        # The bound is tight enough to tell the formats apart: E5M2 exceeds E4M3's.
        normal = x.abs() > 1e-3 * x.abs().max()
        worst_rel = (err[normal] / x.abs()[normal]).max().item()
        assert worst_rel > (2.0**-5 if dtype == torch.float8_e5m2 else 2.0**-6), worst_rel
        if dtype == torch.float8_e5m2:
            assert worst_rel > 2.0**-4


@pytest.mark.parametrize("fmt,scaling", RECIPES)
def test_scaled_matmul_within_the_bound_of_its_operands(fmt, scaling):
    recipe = FP8Recipe(fmt, scaling)
    state = FP8Scaling(recipe, BACKEND.fp8)
    a, b, g = torch.randn(96, 160), torch.randn(72, 160) * 0.05, torch.randn(96, 72) * 1e-3
    gemms = {
        "forward": (a, "input", b, "weight"),
        "dgrad": (g, "grad", b.t().contiguous(), "weight"),
    }
    for name, (x, xr, w, wr) in gemms.items():
        qa, qb = state.quantize(x, xr), state.quantize(w, wr)
        if name == "dgrad" and scaling == "blockwise":  # W^T in 128x128 blocks
            qb = BACKEND.fp8.quantize(w, recipe.dtype("weight"), "128x128")
        got = BACKEND.fp8.scaled_matmul(qa, qb)
        ea, eb = _element_bound(x, qa, qa.data.dtype), _element_bound(w, qb, qb.data.dtype)
        ax, aw = x.abs(), w.abs()
        bound = ax @ eb.t() + ea @ aw.t() + ea @ eb.t()
        bound += x.shape[1] * 2.0**-24 * (ax + ea) @ (aw + eb).t()
        err = (got - x @ w.t()).abs()
        assert (err <= bound).all(), f"{name}: worst excess {(err - bound).max()}"


def test_delayed_scaling_rolls_the_history_and_applies_the_margin():
    recipe = FP8Recipe("hybrid", "delayed", amax_history_len=3, margin=1)
    state = FP8Scaling(recipe, BACKEND.fp8)
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25]
    with torch.enable_grad():
        for step, amax in enumerate(amaxes):
            x = torch.tensor([[amax, -amax / 4]])
            q = state.quantize(x, "input")
            if step > 0:  # quantized with the scale from the history before this call
                past = max(amaxes[max(0, step - 3) : step])
                assert q.scale_inv.item() == pytest.approx(past * 2 / 448.0)
    hist = state.amax_history[0].tolist()
    assert hist == [0.25, 0.5, 1.0]  # newest first, the 3 last
    assert state.scale[0].item() == pytest.approx(448.0 / (1.0 * 2))
    assert state.amax_history[1].abs().sum() == 0  # weight and grad rows untouched


def test_delayed_first_call_is_scaled_just_in_time_and_eval_records_nothing():
    state = FP8Scaling(FP8Recipe("e4m3", "delayed"), BACKEND.fp8)
    x = torch.full((4, 4), 1000.0)
    with torch.no_grad():
        q = state.quantize(x, "input")
    assert q.dequantize().allclose(x)  # not saturated at scale 1
    assert state.amax_history.abs().sum() == 0
    with torch.enable_grad():
        state.quantize(x, "input")
    assert state.amax_history[0, 0] == 1000.0


def test_delayed_state_is_persistent_float32_and_reloads():
    def model():
        m = nn.Module()
        m.fp8 = FP8Scaling(FP8Recipe("hybrid", "delayed", amax_history_len=4), BACKEND.fp8)
        return m

    m = model()
    with torch.enable_grad():
        m.fp8.quantize(torch.tensor([[3.1234567]]), "input")
    MixedPrecision("bf16").cast_module(m)
    assert m.fp8.amax_history.dtype == torch.float32 and m.fp8.scale.dtype == torch.float32
    assert m.fp8.amax_history[0, 0].item() == pytest.approx(3.1234567, rel=1e-7)
    state = m.state_dict()
    assert set(state) == {"fp8.amax_history", "fp8.scale"}
    fresh = model()
    fresh.load_state_dict(state)
    q = fresh.fp8.quantize(torch.tensor([[1.0]]), "input")  # uses the loaded scale
    assert q.scale_inv.item() == pytest.approx(3.1234567 / 448.0)
    assert not FP8Scaling(FP8Recipe(scaling="current"), BACKEND.fp8).state_dict()


@pytest.mark.parametrize("scaling", ["delayed", "current", "blockwise"])
def test_fp8_linear_matches_the_fp32_linear(scaling):
    """Relative (Frobenius) error of y, dx, dW on random data: E4M3 operands give
    ~2^-4/sqrt(3) per element (uniform rounding error), E5M2 gradients twice that;
    0.06 and 0.10 leave ~1.5x headroom over what the cpu backend measures."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 96, generator=g, requires_grad=True)
    w = (torch.randn(72, 96, generator=g) * 0.05).requires_grad_()
    bias = torch.randn(72, generator=g).requires_grad_()
    dy = torch.randn(2, 40, 72, generator=g) * 1e-4
    state = FP8Scaling(FP8Recipe("hybrid", scaling), BACKEND.fp8)
    fp8_linear(x, w, bias, state).backward(dy)
    got = [t.grad.clone() for t in (x, w, bias)]
    for t in (x, w, bias):
        t.grad = None
    y_ref = torch.nn.functional.linear(x, w, bias)
    y_ref.backward(dy)
    y = fp8_linear(x, w, bias, state).detach()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(y, y_ref.detach()) < 0.06
    assert rel(got[0], x.grad) < 0.10 and rel(got[1], w.grad) < 0.10
    assert rel(got[2], bias.grad) < 1e-6  # the bias grad is not quantized


def test_recipe_validation_and_paths():
    with pytest.raises(ValueError, match="fp8 format"):
        FP8Recipe("e5m2")
    with pytest.raises(ValueError, match="fp8 recipe"):
        FP8Recipe(scaling="rowwise")
    with pytest.raises(ValueError, match="amax_history_len"):
        FP8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="fp16"):
        MixedPrecision("fp16", fp8=FP8Recipe())
    keep = FP8Recipe(first_last_high_precision=1)
    assert [keep.applies_to_block(i, 4) for i in range(4)] == [False, True, True, False]
    # per-tensor pairs native on an interface that says so; blocks take the fallback.
    per_tensor = FP8(native_granularities=frozenset({("tensor", "tensor")}))
    assert set(FP8Recipe(scaling="delayed").paths(per_tensor).values()) == {"native"}
    block = FP8Recipe(scaling="blockwise").paths(per_tensor)
    assert block == dict.fromkeys(("forward", "dgrad", "wgrad"), "fallback (matmul in higher precision)")


def test_backend_without_fp8_is_refused():
    from mtcore.backend.device import Availability

    lacking = FP8(available=lambda: Availability(False, "needs compute capability 8.9"))
    with pytest.raises(ValueError, match=r"needs compute capability 8\.9"):
        check_backend_fp8(FP8Recipe(), lacking)
    check_backend_fp8(FP8Recipe(), BACKEND.fp8)


def test_delayed_history_advances_once_per_training_pass():
    """Training forwards record; evaluation (no autograd) and a checkpoint's
    recomputation inside backward do not, so recompute does not double-count."""
    from torch.utils.checkpoint import checkpoint

    state = FP8Scaling(FP8Recipe("hybrid", "delayed", amax_history_len=8), BACKEND.fp8)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    fp8_linear(x, w, None, state).sum().backward()
    with torch.no_grad():
        fp8_linear(x * 100, w, None, state)
    checkpoint(fp8_linear, 2 * x, w, None, state, use_reentrant=False).sum().backward()
    filled = (state.amax_history > 0).sum(dim=1).tolist()
    assert filled == [2, 2, 2], state.amax_history  # input, weight, grad: two passes each
    assert state.amax_history[0, :2].tolist() == pytest.approx(
        [2 * x.abs().max().item(), x.abs().max().item()]
    )


def test_doctor_says_which_recipe_gemms_fall_back(monkeypatch):
    from mtcore.cli import render
    from mtcore.cli.render import _fp8
    from mtcore.cli.report import fp8_facts

    # doctor wraps to the terminal's width; the lines below are whole at 120 columns
    monkeypatch.setattr(render, "WIDTH", 120)

    backend = types.SimpleNamespace(
        fp8=FP8(native_granularities=frozenset({("tensor", "tensor"), ("row", "row")}))
    )
    facts = fp8_facts(backend)
    assert facts["recipes"]["delayed"] == dict.fromkeys(("forward", "dgrad", "wgrad"), "native")
    lines = "\n".join(_fp8(facts))
    assert "recipe blockwise  forward, dgrad, wgrad: fallback (matmul in higher precision)" in lines
    assert "  tensor           native: declared native by the backend" in lines
    assert (
        "  1x128            fallback (matmul in higher precision): no native GEMM for this pair" in lines
    )


def test_gpt_runs_fp8_in_the_middle_blocks_only():
    from mtcore.models.gpt import GPT, GPTConfig, make_context
    from mtcore.parallel.layout import ParallelLayout

    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, seq_len=16)
    recipe = FP8Recipe(first_last_high_precision=1)
    model = GPT(config, make_context(config, ParallelLayout.single(), BACKEND, fp8=recipe))
    fp8_linears = {n.rsplit(".fp8", 1)[0] for n, _ in model.named_buffers() if ".fp8." in n}
    assert fp8_linears == {f"layers.1.{m}" for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    plain = GPT(config, make_context(config, ParallelLayout.single(), BACKEND))
    plain.load_state_dict(model.state_dict(), strict=True)  # the same weights, FP8 state dropped
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens)
    loss.backward()
    assert model.layers["1"].mlp.fc1.weight.grad is not None
    assert loss.item() == pytest.approx(plain(tokens, tokens).item(), rel=1e-2)


def test_checkpoints_load_across_the_fp8_boundary():
    """An FP8-trained state dict loads strictly into a model without FP8 (its FP8 state
    is dropped) and a plain one into an FP8 model (fresh history); other keys still count."""
    from mtcore.parallel.tensor import ColumnParallelLinear, TPGroup

    tp = TPGroup.single(BACKEND)
    fp8 = ColumnParallelLinear(16, 8, tp, fp8=FP8Recipe())
    plain = ColumnParallelLinear(16, 8, tp)
    fp8(torch.randn(2, 3, 16)).sum().backward()
    plain.load_state_dict(fp8.state_dict(), strict=True)
    assert torch.equal(plain.weight, fp8.weight)
    fresh = ColumnParallelLinear(16, 8, tp, fp8=FP8Recipe())
    fresh.load_state_dict(plain.state_dict(), strict=True)
    assert fresh.fp8.amax_history.count_nonzero() == 0
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({"weight": plain.weight.detach()}, strict=True)


def test_engine_keeps_bf16_params_fp32_masters_and_fp32_fp8_state():
    from mtcore.models.gpt import GPTConfig
    from mtcore.parallel.layout import ParallelLayout
    from mtcore.training.engine import Engine

    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, seq_len=16)
    engine = Engine(
        config, ParallelLayout.single(), BACKEND, micro_batch_size=2, num_microbatches=1,
        precision=MixedPrecision("bf16", fp8=FP8Recipe()),
    )  # fmt: skip
    tokens = torch.randint(0, 64, (1, 2, 16), generator=torch.Generator().manual_seed(0))
    before = engine.chunks[0].layers["0"].mlp.fc1.weight.detach().float().clone()
    assert not engine.train_step(lm_batches(tokens, tokens)).skipped
    fc1 = engine.chunks[0].layers["0"].mlp.fc1
    assert fc1.weight.dtype == torch.bfloat16 and fc1.fp8.amax_history.dtype == torch.float32
    assert fc1.fp8.amax_history[:, 0].count_nonzero() == 3  # input, weight, grad recorded
    assert {s.master.dtype for s in engine.optimizer.segments} == {torch.float32}
    assert not torch.equal(fc1.weight.float(), before)  # the step reached the FP8 weight


@pytest.mark.parametrize("scaling", ["current", "blockwise"])
def test_fp8_linear_gemms_are_their_definitions(scaling):
    """Forward, dgrad and wgrad of the FP8 linear equal the products of the quantized
    operands as the module docstring defines them (on CPU blockwise takes the dequantize
    path, per-tensor torch._scaled_mm). Odd sizes: partial 1x128 and 128x128 blocks,
    whose scales must follow the transposes (fused quantize-transpose for x and dy,
    W^T as W's blocks transposed)."""
    recipe = FP8Recipe("hybrid", scaling)
    fp8, e4m3, e5m2 = BACKEND.fp8, torch.float8_e4m3fn, torch.float8_e5m2
    g = torch.Generator().manual_seed(0)
    m, k, n = 130, 200, 150
    x = torch.randn(m, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(m, n, generator=g) * 1e-3
    fp8_linear(x, w, None, FP8Scaling(recipe, fp8)).backward(dy)

    act, wgt = recipe.granularity("input"), recipe.granularity("weight")

    def deq(t, dtype, granularity):  # float64: the products and sums below are exact
        return fp8.quantize(t.detach().contiguous(), dtype, granularity).dequantize().double()

    y = deq(x, e4m3, act) @ deq(w, e4m3, wgt).t()
    dx = deq(dy, e5m2, act) @ deq(w.t(), e4m3, wgt).t()
    dw = deq(dy.t(), e5m2, act) @ deq(x.t(), e4m3, act).t()
    with torch.no_grad():
        got = fp8_linear(x, w, None, FP8Scaling(recipe, fp8))
    # float32 GEMMs: rounding relative to the largest element (cancelling sums of
    # small elements are not good to 1e-5 of themselves, in any summation order)
    for name, result, exact in (("y", got, y), ("dx", x.grad, dx), ("dw", w.grad, dw)):
        err = (result.double() - exact).abs().max() / exact.abs().max()
        assert err <= 1e-6, f"{scaling} {name}: {err:.2e}"
