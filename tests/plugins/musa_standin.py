"""``TorchMusaCpuStandIn``: a CPU stand-in for torch_musa, for wiring tests only. Not MUSA.

torch_musa cannot be installed here. ``install_standin`` registers a module object
(named ``torch_musa_cpu_standin``, flagged ``STANDIN = True``) as
``sys.modules["torch_musa"]`` and as ``torch.musa`` after renaming torch's PrivateUse1
backend to "musa", which cannot be undone: use it in a subprocess only. It answers
with configurable facts (capability, name, count, the arch list torch_musa was
built for, the MUSA version it was built with).

The torch_musa entry points the plugin uses are registered under the names real
torch_musa uses (torch_musa v2.7.1): ``aten::_fused_rmsnorm_forward`` (defined by its
torch patch), ``aten::native_layer_norm`` and ``aten::empty.memory_format`` for
PrivateUse1, ``torch.ops.musa._fused_adamw_``, ``F.rope``, ``F.swish_glu``. Their bodies
are written from torch_musa's tests and kernels, so what the wiring tests check is that
the adapters convert to those conventions, not what muDNN computes. "musa" tensors of
the stand-in are CPU tensors.
"""

from __future__ import annotations

import sys
import types
import warnings

import torch
from torch import Tensor

STANDIN_NAME = "torch_musa_cpu_standin"
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class TorchMusaCpuStandIn(types.ModuleType):
    """Stands in for ``torch_musa`` / ``torch.musa`` with CPU facts. Not MUSA."""

    STANDIN = True

    def __init__(self, capability=(2, 2), name="MTT S4000 (CPU stand-in)", count=1):
        super().__init__(STANDIN_NAME)
        self.capability, self.device_name, self.count = capability, name, count
        self.mudnn_version = 2800  # what torch.backends.mudnn.version() reports
        self.arch_list = ["22"]  # TORCH_MUSA_ARCH_LIST of the build (get_arch_list)
        self.musa_version = 4030  # REAL_MUSA_VERSION of the build: float8 from 4000
        self.arch_list_calls = 0

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def set_device(self, device):
        pass

    def synchronize(self, device=None):
        pass

    def get_device_capability(self, device=None):
        return self.capability

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(name=self.device_name, total_memory=48 << 30)

    def get_arch_list(self):
        """torch_musa/core/device.py: the build's arch flags split ("22 31"), [] if no device."""
        self.arch_list_calls += 1
        return list(self.arch_list) if self.is_available() else []

    def is_bf16_supported(self, including_emulation=True):
        return tuple(self.capability) >= (2, 2)

    def memory_allocated(self, device=None):
        return 0

    def get_rng_state(self, device="musa"):
        return torch.get_rng_state()


def install_standin(**facts) -> TorchMusaCpuStandIn:
    standin = TorchMusaCpuStandIn(**facts)
    sys.modules[STANDIN_NAME] = sys.modules["torch_musa"] = standin
    torch.utils.rename_privateuse1_backend("musa")
    torch._register_device_module("musa", standin)
    torch.backends.mudnn = types.SimpleNamespace(version=lambda: standin.mudnn_version)
    torch.version.musa = None
    standin.aten_impls = torch.library.Library("aten", "IMPL")  # kept alive on the stand-in
    standin_empty(standin)
    standin_scaled_mm(standin)
    return standin


def standin_scaled_mm(standin: TorchMusaCpuStandIn) -> None:
    """``torch._scaled_mm`` for the stand-in's "musa" tensors, which are CPU tensors: a
    CPU kernel (replacing torch's, from 2.8, in this process) computed as muDNN's scaled
    matmul is specified (operands times their scales, one float32 matmul, rounded to
    ``out_dtype``). ``standin.mixed_fp8`` says what it does with an e5m2 x e4m3 pair, which
    torch_musa's tests never run: "right", "wrong" (reads the second operand's bits as
    the first's format) or "raise"."""
    standin.mixed_fp8 = "right"

    def scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                  use_fast_accum=False):  # fmt: skip
        if self.dtype != mat2.dtype:
            if standin.mixed_fp8 == "raise":
                raise RuntimeError("muDNN: unsupported operand dtypes (stand-in)")
            if standin.mixed_fp8 == "wrong":
                mat2 = mat2.view(self.dtype)
        out = (self.float() * scale_a) @ (mat2.float() * scale_b)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype or self.dtype)

    with warnings.catch_warnings():  # "overriding a previously registered kernel" (2.8+)
        warnings.simplefilter("ignore")
        standin.aten_impls.impl("_scaled_mm", scaled_mm, "CPU")


def standin_empty(standin: TorchMusaCpuStandIn) -> None:
    """``aten::empty.memory_format`` for PrivateUse1, allocating on the CPU. A build with
    MUSA < 4.0 cannot make float8 tensors: torch_musa raises "SetMUTensorDType
    Unsupported tensor dtype" in its first muDNN kernel (csrc/aten/utils/Utils.cpp); the
    stand-in raises it at allocation, before the fill the plugin's probe also runs."""

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        if dtype in FLOAT8 and standin.musa_version < 4000:
            name = str(dtype).removeprefix("torch.").replace("float8", "Float8")
            raise RuntimeError(f"SetMUTensorDType Unsupported tensor dtype: {name}")
        return torch.empty(size, dtype=dtype)

    standin.aten_impls.impl("empty.memory_format", empty, "PrivateUse1")

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return empty(size, dtype).as_strided(size, stride)  # what .to("musa") allocates

    standin.aten_impls.impl("empty_strided", empty_strided, "PrivateUse1")


def standin_fused_adamw(seen_steps: list[float]) -> None:
    """Register ``musa::_fused_adamw_`` with torch_musa's schema and a CPU body that
    counts steps as its kernel does (adds 1 to each CPU step tensor, FusedAdam.mu)."""

    @torch.library.custom_op(
        "musa::_fused_adamw_",
        mutates_args=(
            "params",
            "grads",
            "exp_avgs",
            "exp_avg_sqs",
            "max_exp_avg_sqs",
            "state_steps",
        ),
    )
    def _fused_adamw_(
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        max_exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
        lr: float,
        capturable: bool = False,
        differentiable: bool = False,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
        has_complex: bool = False,
        *,
        amsgrad: bool,
        beta1: float,
        beta2: float,
        weight_decay: float,
        eps: float,
        maximize: bool,
    ) -> None:
        assert all(s.device.type == "cpu" and s.dtype == torch.float32 for s in state_steps)
        for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
            s += 1
            step = s.item()
            seen_steps.append(step)
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def register_torch_fused_rms_norm(standin: TorchMusaCpuStandIn) -> None:
    """A PrivateUse1 kernel for torch's own ``aten::_fused_rms_norm`` (torch >= 2.8). No
    torch_musa tag registers this op, so it must not make the plugin claim muDNN."""

    def kernel(input, normalized_shape, weight=None, eps=None):
        raise AssertionError("torch_musa never registers aten::_fused_rms_norm")

    standin.aten_impls.impl("_fused_rms_norm", kernel, "PrivateUse1")


def register_fused_rmsnorm_forward(standin: TorchMusaCpuStandIn) -> None:
    """``aten::_fused_rmsnorm_forward`` as torch_musa's torch patch defines it
    (native_functions.yaml.patch), with a PrivateUse1 kernel as musa_functions.yaml
    registers muDNN's FusedRMSNormForward: (output, invvar), invvar float32."""
    standin.aten_defs = torch.library.Library("aten", "FRAGMENT")
    standin.aten_defs.define(
        "_fused_rmsnorm_forward(Tensor input, SymInt[] normalized_shape, float eps, "
        "Tensor? weight=None) -> (Tensor output, Tensor invvar)"
    )

    def kernel(input, normalized_shape, eps, weight=None):
        dims = tuple(range(-len(normalized_shape), 0))
        xf = input.float()
        invvar = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        out = xf * invvar * (weight.float() if weight is not None else 1.0)
        return out.to(input.dtype), invvar

    standin.aten_impls.impl("_fused_rmsnorm_forward", kernel, "PrivateUse1")


def register_native_layer_norm(standin: TorchMusaCpuStandIn) -> None:
    """A PrivateUse1 kernel for ``aten::native_layer_norm``, as musa_functions.yaml
    registers muDNN's NativeLayerNorm (csrc/aten/ops/LayerNorm.cpp)."""

    def kernel(input, normalized_shape, weight, bias, eps):
        return torch.ops.aten.native_layer_norm.default(
            input.cpu(), normalized_shape, weight, bias, eps
        )

    standin.aten_impls.impl("native_layer_norm", kernel, "PrivateUse1")


class StandinRope:
    """torch_musa's F.rope as its test defines it (test_rope_apply.py,
    apply_rotary_pos_emb_bshd): input [seq, batch, heads, dim], angles [seq, dim], cos and
    sin cast to the input's dtype. It records what it was given, so a test can check the
    adapter uses the layout torch_musa tests: contiguous [s, b, h, d] or a head slice of
    one (strides in non-increasing order over s, b, h; the last dim contiguous)."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, input, freq_cis, rotary_interleaved=False, batch_first=False):
        strides = input.stride()
        self.calls.append(
            {
                "strides": list(strides),
                "tested_layout": strides[-1] == 1 and strides[0] >= strides[1] >= strides[2],
                "freq_dtype": str(freq_cis.dtype),
                "interleaved_or_batch_first": rotary_interleaved or batch_first,
            }
        )
        assert tuple(freq_cis.shape) == (input.shape[0], input.shape[-1])
        cos = freq_cis.cos().to(input.dtype)[:, None, None, :]
        sin = freq_cis.sin().to(input.dtype)[:, None, None, :]
        x1, x2 = input.chunk(2, dim=-1)
        return input * cos + torch.cat((-x2, x1), dim=-1) * sin


def standin_swish_glu(input):
    """torch_musa's F.swish_glu as its test defines it: silu(first half) * second half."""
    a, b = input.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def register_fused_cross_entropy(standin: TorchMusaCpuStandIn) -> None:
    """``aten::_fused_cross_entropy_loss_2d_forward`` as torch_musa's torch patch defines it
    (native_functions.yaml.patch), with a PrivateUse1 kernel as musa_functions.yaml
    registers muDNN's FusedCrossEntropyLoss2dFwd. Real torch_musa reaches it from
    F.cross_entropy (LossNLL.cpp.patch) on arch >= 3.0; the stand-in's F.cross_entropy is
    torch's CPU one, so only the op's presence is what the plugin sees."""
    defs = getattr(standin, "aten_defs", None) or torch.library.Library("aten", "FRAGMENT")
    standin.aten_defs = defs
    defs.define(
        "_fused_cross_entropy_loss_2d_forward(Tensor self, Tensor target, Tensor? weight=None, "
        "int reduction=1, int ignore_index=-100, float label_smoothing=0.0) -> Tensor"
    )

    def kernel(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
        modes = {0: "none", 1: "mean", 2: "sum"}
        return torch.nn.functional.cross_entropy(
            self, target, weight, ignore_index=ignore_index, reduction=modes[reduction],
            label_smoothing=label_smoothing,
        )  # fmt: skip

    standin.aten_impls.impl("_fused_cross_entropy_loss_2d_forward", kernel, "PrivateUse1")
