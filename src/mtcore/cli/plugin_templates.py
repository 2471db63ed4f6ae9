"""The files ``mtcore new-plugin`` writes, as ``string.Template`` texts.

Templates rather than package data: they travel with the code (no manifest to keep
in step), and ``render`` fails on a placeholder nobody filled in instead of writing
it out. Placeholders are ``${name}`` (the backend), ``${package}`` (``mtcore_NAME``),
``${dist}``, ``${class_prefix}``, ``${device_type}``, ``${c10d}`` and the two
requirements; a literal dollar sign is written ``$$``.

The texts stay hardware-neutral, like all of ``src/mtcore``: the skeleton is a
third party's starting point, and mtcore names no vendor.
"""

from __future__ import annotations

from string import Template

PYPROJECT = """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "${dist}"
version = "0.1.0"
description = "mtcore plugin: the ${name} backend"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "${mtcore_requirement}",
    # The torch releases mtcore supports; narrow it to those your extension is built for.
    "${torch_requirement}",
]

[project.optional-dependencies]
test = ["pytest>=8"]

# This table is what makes mtcore find the plugin: the group "mtcore.plugins"; the
# name is the plugin's (mtcore plugins, MTCORE_PLUGINS), the value the hooks' module.
[project.entry-points."mtcore.plugins"]
${package} = "${package}.plugin"

[tool.setuptools]
packages = ["${package}"]
"""

INIT = '''\
"""${dist}: the ${name} backend for mtcore (written by mtcore new-plugin)."""

__version__ = "0.1.0"
'''

PLUGIN = '''\
"""The ${name} backend: the hooks mtcore calls, found through the entry point.

mtcore imports this module in every process that uses it (every rank of every job),
so it imports quickly and without your accelerator's runtime: the device imports the
runtime lazily, on its first availability() call (DEVICE_MODULE.import_name).
Nothing here touches the hardware. README.md says what to fill in.
"""

from __future__ import annotations

from mtcore.backend import (
    FP8,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    Device,
    DeviceCapabilities,
    DeviceModuleSpec,
    TorchModuleDevice,
    fp8_fallback_everywhere,
    gloo_capabilities,
    hookimpl,
)

from ${package}.kernels import kernel_impls

# What users select (MTCORE_BACKEND, --training.backend), the torch device type (as
# in torch.device("${device_type}")), and the name the collective library registers
# with torch.distributed.
BACKEND = "${name}"
DEVICE_TYPE = "${device_type}"
C10D_BACKEND = "${c10d}"

DEVICE_MODULE = DeviceModuleSpec(
    device_type=DEVICE_TYPE,
    # TODO: the module that registers the device type (and the c10d backend) with
    # torch, e.g. your torch extension; imported by availability(). None: built in.
    import_name=None,
    # TODO: the variable that restricts visible devices; its value is shown when no
    # device is visible.
    visible_devices_env=None,
    # TODO: glob patterns of files your driver creates (device nodes such as
    # "/dev/myaccel*"): when one exists but the backend cannot run, automatic selection
    # warns as it falls back to the CPU; with none it passes the backend over quietly.
    device_files=(),
    # TODO: the (major, minor) capability from which bfloat16 is native.
    bf16_min_capability=(0, 0),
    # TODO: (device name, capability) -> {"bfloat16": TFLOP/s, ...}, dense figures
    # from the data sheet (mtcore.backend.peaks_by_name builds one); None: unknown.
    peak_tflops=None,
)


class ${class_prefix}Device(TorchModuleDevice):
    """TorchModuleDevice over torch.get_device_module(DEVICE_TYPE), gaps filled in.

    TorchModuleDevice drives everything through the device module and expects the
    functions of torch's own accelerator modules. Where the module lacks one (the
    host's torch.cpu has no memory statistics, RNG state or device properties, and
    its events cannot time), the methods below answer with mtcore's host defaults
    (mtcore.backend.Device) instead of failing; where it has the function, they pass
    through to it. Host answers are right for the host only: replace them with your
    runtime's calls (the conformance kit tells which are wrong on your device), and
    delete the overrides your module does not need.
    """

    def _module_has(self, function: str) -> bool:
        return callable(getattr(self.module, function, None))

    def _module_or_host(self, function: str, *args):
        owner = TorchModuleDevice if self._module_has(function) else Device
        return getattr(owner, function)(self, *args)

    # -- placement: a module may name its device instead of numbering it, and
    # accept any index in set_device.
    def current_index(self) -> int:
        index = self.module.current_device()
        return index if isinstance(index, int) else 0

    def set_device(self, index: int) -> None:
        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(f"{self.type} has {count} device(s), not index {index}")
        self.module.set_device(index)

    # -- events: an Event class that cannot time takes no arguments.
    def event(self, enable_timing: bool = False):
        try:
            return self.module.Event(enable_timing=enable_timing)
        except TypeError:
            return self.module.Event()

    # -- memory statistics
    def memory_allocated(self) -> int:
        return self._module_or_host("memory_allocated")

    def max_memory_allocated(self) -> int:
        return self._module_or_host("max_memory_allocated")

    def reset_peak_memory_stats(self) -> None:
        self._module_or_host("reset_peak_memory_stats")

    def empty_cache(self) -> None:
        self._module_or_host("empty_cache")

    # -- random numbers (manual_seed is torch.manual_seed: it seeds every generator)
    def get_rng_state(self):
        return self._module_or_host("get_rng_state")

    def set_rng_state(self, state) -> None:
        self._module_or_host("set_rng_state", state)

    # -- capabilities: name, dtypes, memory (and peak TFLOP/s from DEVICE_MODULE)
    def capabilities(self) -> DeviceCapabilities:
        if self._module_has("get_device_properties"):
            return super().capabilities()
        return Device.capabilities(self)


def collective_capabilities() -> CollectiveCapabilities:
    if C10D_BACKEND == "gloo":  # the skeleton's stand-in: what gloo does on this torch
        return gloo_capabilities()
    return CollectiveCapabilities(
        # TODO: the FP8 dtypes travel as bytes and reduce in float32 unless
        # your library carries them: drop them per op only once it does.
        fallback_dtypes=fp8_fallback_everywhere(),
        # Does the library implement ReduceOp.AVG? False: sum, then divide.
        avg_supported=True,
    )


@hookimpl
def mtcore_backends():
    return [
        BackendSpec(
            name=BACKEND,
            device=${class_prefix}Device(DEVICE_MODULE),
            collective=Collective(C10D_BACKEND, collective_capabilities()),
            # TODO: the granularity pairs torch._scaled_mm runs natively on your
            # device, e.g. FP8(native_granularities=frozenset({("tensor", "tensor")}));
            # FP8() declares none, so every scaled matmul dequantizes first.
            fp8=FP8(),
            priority=10,  # among available accelerators, higher is picked first
            # A host backend is never picked automatically, only by name.
            accelerator=DEVICE_TYPE != "cpu",
            description="${name}: generated by mtcore new-plugin",
            # TODO: say what the conformance kit ran on, and what was not tested.
            notes=("a skeleton from mtcore new-plugin, not run on hardware yet",),
        )
    ]


@hookimpl
def mtcore_kernels(backend: str, device_type: str):
    # Called for every backend mtcore builds: contribute only to this one.
    if backend != BACKEND:
        return []
    return kernel_impls(DEVICE_TYPE)
'''

KERNELS = '''\
"""The ${name} kernel pack: faster implementations of mtcore's kernel ops.

mtcore.ops.REFERENCE_OPS holds the reference of every op: it is the spec. A kernel
has exactly its reference's parameter names, in order (mtcore checks the signature
when it builds the backend), matches it within the conformance kit's tolerances,
forward and backward, and raises the same error on bad input. Ops you do not
register run the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mtcore.backend import KernelImpl, KernelQuery
from torch import Tensor


def swiglu(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim (mtcore.ops.swiglu).

    A stand-in written with torch ops: replace the body with your fused kernel.
    """
    if x.dim() == 0 or x.shape[-1] % 2:
        shape = list(x.shape)
        raise ValueError(f"swiglu needs an even last dim [..., 2n], got shape {shape}")
    # In float32 (float64 stays float64) like the reference, then back to x's dtype.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    gate, up = xf.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def floating_on(device_type: str):
    """A predicate: floating tensors on ``device_type``. mtcore asks it once per
    (device type, dtype) and caches the answer, so it reads nothing that changes."""

    def accepts(query: KernelQuery) -> bool:
        return query.device_type == device_type and query.dtype.is_floating_point

    return accepts


def kernel_impls(device_type: str) -> list[KernelImpl]:
    return [
        KernelImpl(
            op="swiglu",
            fn=swiglu,
            name="${name}-swiglu",  # mtcore doctor shows it serving swiglu
            priority=20,  # higher wins among the kernels whose predicate accepts
            predicate=floating_on(device_type),
        )
    ]
'''

CONFORMANCE_TEST = '''\
"""mtcore's conformance kit against the ${name} backend: `pytest tests/` once the
plugin is installed (pip install -e .), on a machine with the device.

The kit is a pytest plugin with its own session and summary, so it runs in a
process of its own rather than nested in this one.
"""

from __future__ import annotations

import subprocess
import sys

import torch

BACKEND = "${name}"
KIT = ["-m", "pytest", "--pyargs", "mtcore.testing.conformance"]
KIT_TIMEOUT_S = 1800


def test_backend_builds_with_the_plugin_kernel():
    from mtcore.backend import KernelQuery, select_backend

    backend = select_backend(BACKEND)
    query = KernelQuery(backend.device.type, torch.float32)
    served_by = backend.kernels["swiglu"].select(query)[0]
    assert (served_by.name, served_by.plugin) == ("${name}-swiglu", "${package}")


def test_conformance_kit_passes():
    options = ["--mtcore-backend", BACKEND, "-q", "-p", "no:cacheprovider"]
    command = [sys.executable, *KIT, *options]
    kit = subprocess.run(command, capture_output=True, text=True, timeout=KIT_TIMEOUT_S)
    output = f"{kit.stdout[-8000:]}\\n{kit.stderr[-2000:]}"
    assert kit.returncode == 0, f"the conformance kit failed on {BACKEND}:\\n{output}"
    assert f"mtcore conformance: backend {BACKEND}" in kit.stdout
'''

README = """\
# ${dist}

An mtcore plugin that adds the backend
`${name}`: torch device type `${device_type}`, c10d backend `${c10d}`. It was
generated by `mtcore new-plugin ${name}`; mtcore's plugin author guide
(docs/plugin-author-guide.md in mtcore) explains every piece.

## Layout

- `pyproject.toml`: the entry point (group `mtcore.plugins`) and the requirements;
- `${package}/plugin.py`: the backend (device, collective, FP8) and the two hooks;
- `${package}/kernels.py`: the kernel pack, `swiglu` written with torch ops;
- `tests/test_conformance.py`: runs mtcore's conformance kit against `${name}`.

## What to fill in

Each place is marked `TODO` in the code.

1. **The device** (`plugin.py`, `DEVICE_MODULE`): `import_name`, the module that
   registers the device type `${device_type}` with torch (your torch extension);
   `visible_devices_env`; `device_files`, your driver's device nodes;
   `bf16_min_capability`; `peak_tflops`, dense figures
   from the data sheet only.
2. **The device's gaps** (`${class_prefix}Device`): where your device module lacks a
   function of torch's accelerator modules (memory statistics, RNG state, device
   properties, timing events), the skeleton answers with the host's values. Put
   your runtime's calls there, and delete the overrides you do not need.
3. **The collective**: `C10D_BACKEND` is the name your collective library
   registers with `torch.distributed.Backend.register_backend`, in the module
   `import_name` imports (every rank selects the backend, and so imports it,
   before it creates a process group). In `collective_capabilities`, keep the FP8
   dtypes in `fallback_dtypes` until the library carries them, and set
   `avg_supported` to whether it implements `ReduceOp.AVG` (while `C10D_BACKEND` is
   `gloo`, the skeleton uses gloo's own capabilities on the installed torch).
4. **FP8**: declare natively only the granularity pairs `torch._scaled_mm` runs on
   your device; `FP8()` declares none (every scaled matmul dequantizes first).
5. **Kernels** (`kernels.py`): `swiglu` is a stand-in written with torch ops.
   Register your fused kernels there, each with exactly the parameter names of
   its reference op in `mtcore.ops.REFERENCE_OPS`.
6. **`notes`**: what the conformance kit ran on, and what was not tested.

## Check it

```bash
pip install -e '.[test]'
mtcore plugins                 # lists ${package} as ok, with its backend
mtcore doctor --backend ${name}  # availability, device, collective table, kernels
pytest tests/                  # the conformance kit against ${name}
mtcore train CONFIG --training.backend ${name}  # train on it
```
"""

FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "${package}/__init__.py": INIT,
    "${package}/plugin.py": PLUGIN,
    "${package}/kernels.py": KERNELS,
    "tests/test_conformance.py": CONFORMANCE_TEST,
}


def render(values: dict[str, str]) -> dict[str, str]:
    """``{relative path: text}`` of the skeleton; KeyError names a placeholder left unset."""
    return {
        Template(path).substitute(values): Template(text).substitute(values)
        for path, text in FILES.items()
    }
