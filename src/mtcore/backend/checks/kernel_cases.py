"""Kernel conformance: inputs per op and the comparison against the reference ops.

Every implementation runs on the backend's device, in the dtype under test, on
inputs rounded to that dtype. The expected value ("golden") is the reference
op of ``mtcore.ops`` on the host in float64, fed the *same rounded inputs*, so
an implementation is charged only for its own error. Stated tolerances, per
dtype of the compared tensor, element-wise::

    |got - want| <= atol * max|want| + rtol * |want|

Cases use odd sizes, and values where the contract matters (an ``eps`` large
enough that forgetting it shows, masked attention rows, ignored targets, empty
experts). ``adamw_step`` state must be float32, so its golden is the reference
on the host with the same dtypes, compared after each of several steps.
``fp8_quantize`` is compared exactly up to one FP8 step (see ``check_fp8_quantize``).

The element-wise bfloat16 tolerance is loose (rtol 1.6e-2), so a kernel that is
wrong by a systematic 1% passes it. Every bfloat16 output and gradient of
``check_op`` is therefore also checked for bias (``check_unbiased``): its mean
signed relative error against the float64 golden must be near zero, within a
bound derived from bfloat16's unit roundoff and the element count. It has no
work in ``check_adamw`` (the state is float32; one bf16 parameter update is
below a bf16 step of the parameter) nor in the FP8 checks (``data`` must equal
round-to-nearest-even on all but 0.1% of elements, which a bias cannot pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtcore.ops import FP8_MAX, REFERENCE_OPS, rope_tables
from mtcore.ops.attention_dropout import head_seeds


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # times max |expected| of the compared tensor


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1e-4, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-2),
    # fp16 keeps 11 significant bits (bfloat16 8): the same few roundings' worth.
    torch.float16: Tolerance(rtol=2e-3, atol=1.25e-3),
}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DIFFERENTIABLE = (
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "attention",
    "attention_lse",
    "cross_entropy",
    "grouped_mm",
)
ADAMW_STEPS = 5
# fp8_quantize: data may differ by one FP8 step on at most this fraction of elements.
FP8_MAX_OFF_BY_ONE = 1e-3
_FP8_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_FP8_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}

# Bias check (``check_unbiased``). Unit roundoff u: rounding to nearest gives
# |fl(x) - x| <= u |x|; bfloat16 keeps 8 significant bits, so u = 2**-8. Only the
# dtypes listed are checked: float32 outputs have an element-wise rtol of 1e-4,
# which a bias cannot hide under, and float32 kernels' own reduction error is
# larger than float32 rounding, so u would not bound it.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Hoeffding's inequality gives the bound (see check_unbiased): an honest kernel
# exceeds BIAS_SIGMAS * u / sqrt(n_eff) with probability 2 exp(-BIAS_SIGMAS**2 / 2),
# 3e-8 for 6.
BIAS_SIGMAS = 6.0
# Below this effective element count the bound (6 u / 8 = 2.9e-3 at 64) nears the
# element-wise tolerance and the check adds nothing, so smaller tensors skip it.
MIN_EFFECTIVE_ELEMENTS = 64


# -- inputs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class X:
    """A tensor of the dtype under test (rounded to it); ``grad``: compare its gradient;
    ``strided``: handed to the implementation non-contiguous, its last two dimensions
    laid out transposed in memory (stride 1 on the second to last): a kernel must honour
    any strides it is given, or copy."""

    value: torch.Tensor
    grad: bool = True
    strided: bool = False


@dataclass(frozen=True)
class F32:
    """A float32 tensor whatever the dtype under test (rope tables)."""

    value: torch.Tensor


@dataclass(frozen=True)
class Fixed:
    """A tensor passed unchanged (targets, masks, counts)."""

    value: torch.Tensor


@dataclass
class Case:
    name: str
    args: list
    kwargs: dict = field(default_factory=dict)


def _materialize(arg, dtype, device, golden: bool):
    # Copies throughout: an implementation must not see (or change) another's inputs.
    if isinstance(arg, X):
        t = arg.value.to(dtype, copy=True)
        t = t.double() if golden else t.to(device)
        if arg.strided and not golden:
            t = _transposed_layout(t)
        return t.requires_grad_(arg.grad)
    if isinstance(arg, F32):
        return arg.value.double() if golden else arg.value.to(device, copy=True)
    if isinstance(arg, Fixed):
        return arg.value.to("cpu" if golden else device, copy=True)
    return arg


def _transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a leaf tensor whose last two dimensions are stored transposed."""
    if t.dim() < 2:
        return t
    strides = list(torch.empty(*t.shape[:-2], t.shape[-1], t.shape[-2]).stride())
    strides[-2], strides[-1] = strides[-1], strides[-2]
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    assert not out.is_contiguous()
    return out


def materialize(case: Case, dtype, device, golden: bool = False) -> tuple[list, dict]:
    args = [_materialize(a, dtype, device, golden) for a in case.args]
    kwargs = {k: _materialize(v, dtype, device, golden) for k, v in case.kwargs.items()}
    return args, kwargs


def _grad_leaves(case: Case, args: list, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    named = [
        (f"arg{i}", spec, val) for i, (spec, val) in enumerate(zip(case.args, args, strict=True))
    ]
    named += [(k, case.kwargs[k], kwargs[k]) for k in case.kwargs]
    return [(name, val) for name, spec, val in named if isinstance(spec, X) and spec.grad]


def _randn(seed: int, *shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale + shift


def _cases_rms_norm() -> list[Case]:
    return [
        Case(
            "3x7x33-eps0.1", [X(_randn(1, 3, 7, 33)), X(_randn(2, 33, scale=0.1, shift=1.0)), 0.1]
        ),
        Case("5x129-small-x-eps1e-5", [X(_randn(3, 5, 129, scale=1e-3)), X(_randn(4, 129)), 1e-5]),
        Case(
            "2x3x65-default-eps", [X(_randn(5, 2, 3, 65, scale=1e-3)), X(_randn(6, 65, shift=1.0))]
        ),
        Case("strided-6x5x33", [X(_randn(15, 6, 5, 33), strided=True), X(_randn(16, 33))]),
    ]


def _cases_layer_norm() -> list[Case]:
    return [
        Case(
            "4x9x65", [X(_randn(7, 4, 9, 65)), X(_randn(8, 65, shift=1.0)), X(_randn(9, 65)), 1e-5]
        ),
        Case(
            "3x257-no-bias-eps0.1",
            [X(_randn(10, 3, 257, scale=0.3)), X(_randn(11, 257)), None, 0.1],
        ),
        Case(
            "2x5x33-offset-mean-default-eps",
            [X(_randn(12, 2, 5, 33, scale=0.05, shift=4.0)), X(_randn(13, 33)), X(_randn(14, 33))],
        ),
        Case(
            "strided-7x65",
            [X(_randn(17, 7, 65), strided=True), X(_randn(18, 65, shift=1.0)), X(_randn(19, 65))],
        ),
    ]


def _cases_rope() -> list[Case]:
    cases = []
    for i, (b, s, h, d, theta, offset) in enumerate(
        [(2, 11, 3, 16, 10000.0, 0), (1, 7, 5, 64, 500000.0, 1000), (3, 1, 2, 2, 10000.0, 5)]
    ):
        cos, sin = rope_tables(s, d, theta=theta, offset=offset)
        cases.append(
            Case(
                f"{b}x{s}x{h}x{d}-offset{offset}",
                [X(_randn(20 + i, b, s, h, d)), F32(cos), F32(sin)],
            )
        )
    return cases


def _cases_swiglu() -> list[Case]:
    return [
        Case("3x5x34", [X(_randn(30, 3, 5, 34))]),
        Case("7x256-large", [X(_randn(31, 7, 256, scale=4.0))]),
        Case("1x2", [X(_randn(32, 1, 2))]),
        Case("strided-9x34", [X(_randn(33, 9, 34), strided=True)]),
    ]


def _attn(seed, b, hq, hkv, sq, sk, d, strided=False):
    return [
        X(_randn(seed, b, hq, sq, d), strided=strided),
        X(_randn(seed + 1, b, hkv, sk, d), strided=strided),
        X(_randn(seed + 2, b, hkv, sk, d), strided=strided),
    ]


def _cases_attention() -> list[Case]:
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, 6:] = False
    pad[1, :] = False  # batch 1: every key is padding, so every row is fully masked
    first_masked = torch.ones(1, 7, dtype=torch.bool)
    first_masked[0, 0] = False  # with causal masking, query 0 may attend no key
    first_masked_long = torch.ones(1, 11, dtype=torch.bool)
    first_masked_long[0, 8] = False
    return [
        Case("causal-2x4x13x16", _attn(40, 2, 4, 4, 13, 13, 16), {"causal": True}),
        Case("causal-gqa-decode-1x6/2x5/17x32", _attn(43, 1, 6, 2, 5, 17, 32), {"causal": True}),
        Case(
            "noncausal-mqa-padding-2x2/1x9x8",
            _attn(46, 2, 2, 1, 9, 9, 8),
            {"causal": False, "key_padding_mask": Fixed(pad)},
        ),
        Case(
            "causal-strided-1x2x11x16",
            _attn(52, 1, 2, 2, 11, 11, 16, strided=True),
            {"causal": True},
        ),
        Case(
            "causal-masked-row-scale0.5-1x3x7x24",
            _attn(49, 1, 3, 3, 7, 7, 24),
            {"causal": True, "key_padding_mask": Fixed(first_masked), "scale": 0.5},
        ),
        # Sliding windows: square, and fewer queries than keys (the band is counted
        # from the bottom-right corner), with a padding key inside the band.
        Case("causal-window4-gqa-2x4/2x13x16", _attn(54, 2, 4, 2, 13, 13, 16), {"window": 4}),
        Case(
            "causal-window3-padding-1x2x5/11x8",
            _attn(56, 1, 2, 2, 5, 11, 8),
            {"window": 3, "key_padding_mask": Fixed(first_masked_long)},
        ),
        *_cases_attention_documents(),
        # Sequences as long as jobs use (a kernel may switch paths above some query
        # count: one that dropped the causal mask above 64 queries passed cases of 17).
        Case("causal-long-1x2x129x16", _attn(66, 1, 2, 2, 129, 129, 16), {"causal": True}),
        Case("causal-long-gqa-1x2/1x130x8", _attn(68, 1, 2, 1, 130, 130, 8), {"causal": True}),
    ]


def job_attention_case(seq_len: int, heads: int = 2, kv_heads: int = 1, head_dim: int = 8) -> Case:
    """A causal attention case at a job's sequence length (the trainer's self-check adds it
    to the kit's cases for ``attention`` and ``attention_lse``)."""
    return Case(
        f"causal-job-1x{heads}/{kv_heads}x{seq_len}x{head_dim}",
        _attn(70, 1, heads, kv_heads, seq_len, seq_len, head_dim),
        {"causal": True},
    )


def _documents(*lengths_per_row: tuple[int, ...]) -> torch.Tensor:
    """Document ids ``[rows, sum(lengths)]`` of packed samples, one row per tuple."""
    rows = [
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in lengths_per_row
    ]
    return torch.stack(rows)


def _cases_attention_documents() -> list[Case]:
    """Packed samples with document boundaries: a kernel that ignores them lets queries
    see the documents before their own and fails every one of these."""
    square = _documents((4, 3, 6), (1, 11, 1))
    decode = _documents((3, 5, 3))  # 11 keys; the last 5 are the queries (a cache)
    return [
        Case(
            "causal-documents-gqa-2x4/2x13x16",
            _attn(60, 2, 4, 2, 13, 13, 16),
            {"query_documents": Fixed(square), "key_documents": Fixed(square)},
        ),
        Case(
            "noncausal-documents-padding-1x2x9x8",
            _attn(62, 1, 2, 2, 9, 9, 8),
            {
                "causal": False,
                "key_padding_mask": Fixed(_first_keys(9, 7)),
                "query_documents": Fixed(_documents((2, 5, 2))),
                "key_documents": Fixed(_documents((2, 5, 2))),
            },
        ),
        Case(
            "causal-documents-window4-1x2x5/11x8",
            _attn(64, 1, 2, 2, 5, 11, 8),
            {"window": 4, "query_documents": Fixed(decode[:, -5:]), "key_documents": Fixed(decode)},
        ),
    ]


def _first_keys(total: int, kept: int) -> torch.Tensor:
    mask = torch.zeros(1, total, dtype=torch.bool)
    mask[0, :kept] = True
    return mask


def _cases_attention_with_dropout() -> list[Case]:
    """``attention``'s cases and one with the op's coordinate-hashed dropout (a kernel
    without it declines the case in ``fallback_ok``; ``attention_lse`` has no dropout)."""
    seeds = head_seeds(torch.tensor(5), 0, 4)
    dropout = Case(
        "causal-dropout0.25-gqa-2x4/2x9x8",
        _attn(58, 2, 4, 2, 9, 9, 8),
        {"dropout_p": 0.25, "dropout_seeds": Fixed(seeds)},
    )
    return [*_cases_attention(), dropout]


def _cases_cross_entropy() -> list[Case]:
    g = torch.Generator().manual_seed(60)
    t1 = torch.randint(0, 101, (13,), generator=g)
    t1[[2, 9]] = -100
    t2 = torch.randint(0, 3000, (4,), generator=g)
    t2[1] = 7
    return [
        Case("13x101-ignored", [X(_randn(61, 13, 101)), Fixed(t1)]),
        Case("4x3000-peaky-ignore7", [X(_randn(62, 4, 3000, scale=5.0)), Fixed(t2), 7]),
        Case("1x2", [X(_randn(63, 1, 2)), Fixed(torch.tensor([1]))]),
        # Many tokens, so the per-token losses and their gradients are enough
        # elements for the bias check.
        Case("strided-11x40", [X(_randn(65, 11, 40), strided=True), Fixed(t1[:11].clamp(max=39))]),
        Case(
            "257x50-many-tokens",
            [X(_randn(64, 257, 50)), Fixed(torch.randint(0, 50, (257,), generator=g))],
        ),
    ]


def _cases_grouped_mm() -> list[Case]:
    cases = []
    for i, (k, n, counts) in enumerate(
        [(33, 17, [5, 0, 8]), (64, 40, [1, 2, 6, 7]), (8, 3, [0, 1])]
    ):
        t, e = sum(counts), len(counts)
        cases.append(
            Case(
                f"{t}x{k}x{n}-experts{counts}",
                [
                    X(_randn(70 + i, t, k)),
                    X(_randn(80 + i, e, k, n, scale=k**-0.5)),
                    Fixed(torch.tensor(counts)),
                ],
            )
        )
    return cases


CASES: dict[str, Callable[[], list[Case]]] = {
    "rms_norm": _cases_rms_norm,
    "layer_norm": _cases_layer_norm,
    "rope": _cases_rope,
    "swiglu": _cases_swiglu,
    "attention": _cases_attention_with_dropout,
    "attention_lse": _cases_attention,  # same arguments; also returns the LSE (float32)
    "cross_entropy": _cases_cross_entropy,
    "grouped_mm": _cases_grouped_mm,
}


# -- comparison ------------------------------------------------------------------------
def compare(got: torch.Tensor, want: torch.Tensor, what: str, tol: Tolerance | None = None) -> None:
    """Raise AssertionError naming ``what`` unless ``got`` is within tolerance of ``want``."""
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, expected a tensor"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {list(got.shape)}, expected {list(want.shape)}"
    )
    tol = tol or TOLERANCES[got.dtype]
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    same_inf = torch.isinf(w) & (g == w)  # -inf LSE of a row that may attend no key
    if not (torch.isfinite(g) | same_inf).all():
        raise AssertionError(f"{what}: non-finite values where the reference is finite")
    if (torch.isinf(w) & ~same_inf).any():
        raise AssertionError(f"{what}: finite values where the reference is infinite")
    g, w = g.masked_fill(same_inf, 0.0), w.masked_fill(same_inf, 0.0)
    scale = w.abs().max().item() if w.numel() else 0.0
    err = (g - w).abs()
    bound = tol.atol * scale + tol.rtol * w.abs()
    if (err > bound).any():
        i = int(((err - bound) / (scale or 1.0)).argmax())
        idx = list(torch.unravel_index(torch.tensor(i), w.shape)) if w.dim() else []
        raise AssertionError(
            f"{what}: {int((err > bound).sum())} of {w.numel()} elements out of tolerance "
            f"(rtol={tol.rtol:g}, atol={tol.atol:g} x max|ref|={scale:.3g}); worst at "
            f"{[int(j) for j in idx]}: got {g.flatten()[i].item():.6g}, reference {w.flatten()[i].item():.6g}, "
            f"max abs error {err.max().item():.3g}"
        )


def check_unbiased(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise AssertionError naming ``what`` if ``got`` is systematically off ``want``.

    The statistic is the mean signed relative error weighted by ``|want|``::

        M = sum((got_i - want_i) * sign(want_i)) / sum(|want_i|)

    the relative error ``(got_i - want_i) / want_i`` of every element, weighted
    by ``|want_i|`` so that elements near zero (whose relative error means
    nothing) count little. A kernel that returns ``(1 + b)`` times the exact
    value has ``M = b`` exactly, whatever the signs of the values.

    Bound: an honest bfloat16 result is the exact value rounded to nearest (even),
    ``got_i - want_i = d_i * want_i`` with ``|d_i| <= u`` (``UNIT_ROUNDOFF``),
    of zero mean and independent across elements, as the rounding errors of
    unrelated values are. Each term of the numerator lies in
    ``[-u |want_i|, u |want_i|]``, so Hoeffding's inequality gives
    ``P(|M| >= t) <= 2 exp(-t**2 n_eff / (2 u**2))`` with the effective element
    count ``n_eff = sum(|want_i|)**2 / sum(want_i**2)`` (``n`` when all ``|want_i|``
    are equal, fewer when a few elements dominate). ``t = BIAS_SIGMAS * u /
    sqrt(n_eff)`` makes that ``2 exp(-BIAS_SIGMAS**2 / 2)``. Kernels that round
    intermediates too (SDPA's bf16 path on the host) have larger but still
    unbiased errors: the kit's own kernels, and the Triton pack, stay within 2.4
    u / sqrt(n_eff) on every case. Tensors of another dtype, non-finite reference
    elements (the LSE of a row without keys), and tensors with ``n_eff <
    MIN_EFFECTIVE_ELEMENTS`` are not checked.
    """
    u = UNIT_ROUNDOFF.get(got.dtype)
    if u is None:
        return
    g, w = got.detach().cpu().double().flatten(), want.detach().cpu().double().flatten()
    finite = torch.isfinite(w)
    g, w = g[finite], w[finite]
    total = w.abs().sum().item()
    if total == 0.0:
        return
    n_eff = total**2 / w.pow(2).sum().item()
    if n_eff < MIN_EFFECTIVE_ELEMENTS:
        return
    mean = ((g - w) * w.sign()).sum().item() / total
    bound = BIAS_SIGMAS * u / n_eff**0.5
    if abs(mean) > bound:
        raise AssertionError(
            f"{what}: mean signed relative error {mean:+.3g} over {w.numel()} elements "
            f"(effective count {n_eff:.0f}), a systematic bias: honest {dtype_name(got.dtype)} "
            f"rounding to nearest averages out within +-{bound:.2g} ({BIAS_SIGMAS:g} u / "
            f"sqrt(n_eff), u = 2**{math.log2(u):g}). Being within the element-wise tolerance "
            "is not enough; truncating instead of rounding is a bias too."
        )


def _outputs(result, where: str) -> list[torch.Tensor]:
    """An op's result as a list of tensors (``attention_lse`` returns two)."""
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    for t in results:
        assert isinstance(t, torch.Tensor), f"{where}: got {type(t).__name__}, expected a tensor"
    return results


def check_op(
    op: str, fn: Callable, guard: Callable | None, dtype, device, extra: list[Case] = ()
) -> list[str]:
    """Forward (and backward where differentiable) of ``fn`` vs the float64 reference.

    Returns the names of the cases run; raises AssertionError on the first mismatch.
    Cases that the implementation's ``fallback_ok`` guard declines are not its to serve.
    ``extra``: cases after the kit's (the trainer's, at the job's sizes).
    """
    reference = REFERENCE_OPS[op]
    ran = []
    for case in [*CASES[op](), *extra]:
        args, kwargs = materialize(case, dtype, device)
        if guard is not None and not guard(*args, **kwargs):
            continue
        where = f"{op} case {case.name!r} ({str(dtype).removeprefix('torch.')})"
        outs = _outputs(fn(*args, **kwargs), where)
        gargs, gkwargs = materialize(case, dtype, "cpu", golden=True)
        wants = _outputs(reference(*gargs, **gkwargs), where)
        host_args, host_kwargs = materialize(case, dtype, "cpu")
        want_dtypes = [t.dtype for t in _outputs(reference(*host_args, **host_kwargs), where)]
        assert len(outs) == len(wants), (
            f"{where}: {len(outs)} outputs, the reference gives {len(wants)}"
        )
        for i, (out, want, want_dtype) in enumerate(zip(outs, wants, want_dtypes, strict=True)):
            what = f"{where} forward" + (f", output {i}" if len(outs) > 1 else "")
            assert out.dtype == want_dtype, (
                f"{what}: dtype {out.dtype}, the reference gives {want_dtype}"
            )
            compare(out, want, what)
            check_unbiased(out, want, what)
        if op in DIFFERENTIABLE:
            assert all(out.requires_grad for out in outs), (
                f"{where}: an output does not require grad; the op is differentiable"
            )
            g = torch.Generator().manual_seed(99)
            grad_outs = [torch.randn(*out.shape, generator=g).to(out.dtype) for out in outs]
            torch.autograd.backward(outs, [t.to(outs[0].device) for t in grad_outs])
            torch.autograd.backward(wants, [t.double() for t in grad_outs])
            for (name, leaf), (_, gleaf) in zip(
                _grad_leaves(case, args, kwargs), _grad_leaves(case, gargs, gkwargs), strict=True
            ):
                assert leaf.grad is not None, f"{where}: no gradient for {name}"
                assert leaf.grad.dtype == leaf.dtype, (
                    f"{where}: grad of {name} is {leaf.grad.dtype}, not {leaf.dtype}"
                )
                compare(leaf.grad, gleaf.grad, f"{where} backward, grad of {name}")
                check_unbiased(leaf.grad, gleaf.grad, f"{where} backward, grad of {name}")
        ran.append(case.name)
    return ran


def check_adamw(fn: Callable, guard: Callable | None, dtype, device) -> list[str]:
    """Several steps of ``fn`` vs the reference on the host, same dtypes, compared every step."""
    shapes = [(33,), (5, 17), (1,)]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    init = [_randn(90 + i, *s).to(dtype) for i, s in enumerate(shapes)]
    mine = [[p.clone().to(device) for p in init], [], [], []]
    ref = [[p.clone() for p in init], [], [], []]
    for state in (mine, ref):
        dev = device if state is mine else "cpu"
        state[2] = [torch.zeros(s, dtype=torch.float32, device=dev) for s in shapes]
        state[3] = [torch.zeros(s, dtype=torch.float32, device=dev) for s in shapes]
    for step in range(1, ADAMW_STEPS + 1):
        grads = [
            _randn(100 * step + i, *s, scale=10.0 ** (i - 1)).to(dtype)
            for i, s in enumerate(shapes)
        ]
        mine[1] = [g.to(device) for g in grads]
        ref[1] = grads
        if guard is not None and not guard(*mine, step=step, **hyper):
            return []
        fn(*mine, step=step, **hyper)
        REFERENCE_OPS["adamw_step"](*ref, step=step, **hyper)
        for k, name in ((0, "params"), (2, "exp_avgs"), (3, "exp_avg_sqs")):
            for i, (got, want) in enumerate(zip(mine[k], ref[k], strict=True)):
                assert got.dtype == want.dtype, f"adamw_step: {name}[{i}] became {got.dtype}"
                compare(
                    got,
                    want,
                    f"adamw_step ({str(dtype).removeprefix('torch.')}) step {step}: {name}[{i}]",
                )
    return [f"{ADAMW_STEPS} steps"]


def fp8_quantize_cases() -> list[tuple[str, torch.Tensor, torch.dtype, str, float | None]]:
    zero_row = _randn(111, 130, 257)
    zero_row[3] = 0.0
    inputs = [
        ("37x300", _randn(110, 37, 300, scale=3.0)),
        ("130x257-zero-row", zero_row),
        ("1x1", _randn(112, 1, 1)),
    ]
    cases = []
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        short = "e4m3" if fmt is torch.float8_e4m3fn else "e5m2"
        for label, x in inputs:
            for gran in ("tensor", "row", "1x128", "128x128"):
                cases.append((f"{label}-{short}-{gran}", x, fmt, gran, None))
        cases.append((f"37x300-{short}-tensor-given-scale", inputs[0][1], fmt, "tensor", 7.5))
        # Delayed scaling near the format's max: the scale puts max|x| at 1.25x FP8_MAX,
        # so the top values saturate at the max and those below keep theirs (a kernel
        # saturating e4m3 at 240 instead of 448 passed a case that peaked near 92).
        x = inputs[0][1]
        at_max = 1.25 * FP8_MAX[fmt] / x.abs().max().item()
        cases.append((f"37x300-{short}-tensor-given-scale-at-max", x, fmt, "tensor", at_max))
    return cases


def check_fp8_quantize(fn: Callable, guard: Callable | None, dtype, device) -> list[str]:
    """data (as float) within one FP8 step (and equal nearly everywhere); scale_inv, amax exact."""
    reference = REFERENCE_OPS["fp8_quantize"]
    ran = []
    for name, x, fmt, gran, scale in fp8_quantize_cases():
        where = f"fp8_quantize case {name!r} ({str(dtype).removeprefix('torch.')} input)"
        xd = x.to(dtype)
        if guard is not None and not guard(xd.to(device), fmt, gran, scale):
            continue
        got = fn(xd.to(device), fmt, gran, scale)
        _compare_fp8(where, got, reference(xd, fmt, gran, scale), fmt)
        ran.append(name)
    return ran


def _compare_fp8(where: str, got, want, fmt: torch.dtype) -> None:
    data, scale_inv, amax = got
    w_data, w_scale_inv, w_amax = want
    assert data.dtype == fmt, f"{where}: data dtype {data.dtype}, expected {fmt}"
    assert scale_inv.dtype == torch.float32 and amax.dtype == torch.float32, (
        f"{where}: scale_inv/amax must be float32"
    )
    compare(amax.float(), w_amax, f"{where}: amax", Tolerance(0.0, 0.0))
    compare(scale_inv.float(), w_scale_inv, f"{where}: scale_inv", Tolerance(2.4e-7, 0.0))
    step = Tolerance(2.0 ** -_FP8_MANTISSA[fmt], 0.0)
    g, w = data.float().cpu(), w_data.float()
    slack = _FP8_MIN_SUBNORMAL[fmt]
    compare(g, w, f"{where}: data", Tolerance(step.rtol, slack / max(w.abs().max().item(), slack)))
    off = (g != w).float().mean().item()
    assert off <= FP8_MAX_OFF_BY_ONE, (
        f"{where}: data differs from the reference on {off:.2%} of elements (rounding must be "
        f"round-to-nearest-even; at most {FP8_MAX_OFF_BY_ONE:.1%} may differ by one step)"
    )


def check_fp8_quantize_transpose(fn: Callable, guard: Callable | None, dtype, device) -> list[str]:
    """Both halves of ``fp8_quantize_transpose`` under the rules of :func:`check_fp8_quantize`."""
    reference = REFERENCE_OPS["fp8_quantize_transpose"]
    ran = []
    for name, x, fmt, gran, scale in fp8_quantize_cases():
        where = f"fp8_quantize_transpose case {name!r} ({str(dtype).removeprefix('torch.')} input)"
        xd = x.to(dtype)
        if guard is not None and not guard(xd.to(device), fmt, gran, scale):
            continue
        got, got_t = fn(xd.to(device), fmt, gran, scale)
        want, want_t = reference(xd, fmt, gran, scale)
        _compare_fp8(where, got, want, fmt)
        _compare_fp8(f"{where} (transpose)", got_t, want_t, fmt)
        assert got_t[0].is_contiguous(), f"{where}: the transposed data must be contiguous"
        ran.append(name)
    return ran


def check_fp8_dequantize(fn: Callable, guard: Callable | None, dtype, device) -> list[str]:
    """FP8 bytes of the quantize cases back to ``dtype``: exactly the reference's values
    (one float32 product per element, rounded once), for every granularity and format."""
    reference = REFERENCE_OPS["fp8_dequantize"]
    quantize = REFERENCE_OPS["fp8_quantize"]
    ran = []
    for name, x, fmt, gran, scale in fp8_quantize_cases():
        where = f"fp8_dequantize case {name!r} (to {dtype_name(dtype)})"
        data, scale_inv, _ = quantize(x, fmt, gran, scale)
        data_d, scale_inv_d = data.to(device), scale_inv.to(device)
        if guard is not None and not guard(data_d, scale_inv_d, gran, dtype):
            continue
        got = fn(data_d, scale_inv_d, gran, out_dtype=dtype)
        assert got.dtype == dtype, f"{where}: dtype {got.dtype}, expected {dtype}"
        compare(got, reference(data, scale_inv, gran, out_dtype=dtype), where, Tolerance(0.0, 0.0))
        ran.append(name)
    return ran


# Ops whose check is a function of its own, not ``check_op``'s forward/backward cases.
SPECIAL_CHECKS: dict[str, Callable[..., list[str]]] = {
    "adamw_step": check_adamw,
    "fp8_quantize": check_fp8_quantize,
    "fp8_quantize_transpose": check_fp8_quantize_transpose,
    "fp8_dequantize": check_fp8_dequantize,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
