"""The kernel interface: a registry of named ops with pluggable implementations.

``mtcore.ops`` holds the reference implementation of every op; its signature is
the contract. Plugins register faster implementations with a priority and a
predicate on (device type, dtype). A call resolves once per (device type, dtype)
and is then a dict look-up. ``MTCORE_KERNELS=reference`` forces the reference
implementations everywhere, to debug numerics.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mtcore.ops import REFERENCE_OPS

REFERENCE = "reference"
KERNELS_ENV = "MTCORE_KERNELS"


@dataclass(frozen=True)
class KernelQuery:
    """What a predicate sees: the device type and dtype of the op's leading tensor."""

    device_type: str
    dtype: torch.dtype


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of an op.

    op: the op name (a key of ``mtcore.ops.REFERENCE_OPS``).
    fn: callable with the same parameter names as the reference op.
    name: shown by ``mtcore doctor`` (for example "sdpa" or "torch-fused").
    priority: higher wins among implementations whose predicate accepts.
    predicate: KernelQuery -> bool; None accepts everything.
    fallback_ok: shape guard, called with the op's arguments on every call when
      given; when it returns False the next implementation serves that call.
      Use it only for limits that the predicate cannot see (head size, ...).
    plugin: filled in by the registry with the contributing plugin's name.
    """

    op: str
    fn: Callable
    name: str
    priority: int = 10
    predicate: Callable[[KernelQuery], bool] | None = None
    fallback_ok: Callable[..., bool] | None = None
    plugin: str = ""

    def accepts(self, query: KernelQuery) -> bool:
        return self.predicate is None or bool(self.predicate(query))


class KernelRegistrationError(ValueError):
    """A plugin offered an implementation that does not fit the op's contract."""


def check_signature(impl: KernelImpl) -> None:
    """Reject an implementation whose parameters differ from the reference op's."""
    if impl.op not in REFERENCE_OPS:
        raise KernelRegistrationError(
            f"plugin {impl.plugin!r} registered kernel {impl.name!r} for unknown op "
            f"{impl.op!r}; known ops: {', '.join(sorted(REFERENCE_OPS))}"
        )
    want = _param_names(REFERENCE_OPS[impl.op])
    try:
        got = _param_names(impl.fn)
    except (TypeError, ValueError) as exc:
        raise KernelRegistrationError(
            f"plugin {impl.plugin!r}: kernel {impl.name!r} for op {impl.op!r} has no "
            f"inspectable signature ({exc})"
        ) from exc
    if got != want:
        raise KernelRegistrationError(
            f"plugin {impl.plugin!r}: kernel {impl.name!r} for op {impl.op!r} has "
            f"parameters ({', '.join(got)}) but the op's contract is ({', '.join(want)})"
        )


def _param_names(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


class OpDispatcher:
    """Callable for one op on one backend: resolves per (device type, dtype), then caches."""

    __slots__ = ("_cache", "_first", "_force_reference", "_listed", "candidates", "op")

    def __init__(self, op: str, candidates: list[KernelImpl], force_reference: bool):
        self.op = op
        self.candidates = sorted(candidates, key=lambda c: -c.priority)
        self._force_reference = force_reference
        # The leading tensor decides the implementation: the first argument, or
        # the first element of it for multi-tensor ops (adamw_step's params).
        self._first = next(iter(inspect.signature(REFERENCE_OPS[op]).parameters))
        self._listed = op == "adamw_step"
        self._cache: dict[tuple[torch.device, torch.dtype], Callable] = {}

    def __call__(self, *args, **kwargs):
        t = args[0] if args else kwargs[self._first]
        if self._listed:
            t = t[0]
        # Keyed on the device object: reading ``device.type`` costs more than the look-up.
        key = (t.device, t.dtype)
        fn = self._cache.get(key)
        if fn is None:
            fn = self._resolve_and_cache(key)
        return fn(*args, **kwargs)

    def select(self, query: KernelQuery) -> list[KernelImpl]:
        """The implementations that serve ``query``, in the order they are tried."""
        if self._force_reference:
            return [c for c in self.candidates if c.name == REFERENCE]
        chosen = []
        for impl in self.candidates:
            if impl.accepts(query):
                chosen.append(impl)
                if impl.fallback_ok is None:
                    break
        return chosen

    def _resolve_and_cache(self, key: tuple[torch.device, torch.dtype]) -> Callable:
        chain = self.select(KernelQuery(key[0].type, key[1]))
        fn = chain[0].fn if len(chain) == 1 else _guarded_chain(chain)
        self._cache[key] = fn
        return fn


def _guarded_chain(chain: list[KernelImpl]) -> Callable:
    *guarded, last = chain

    def call(*args, **kwargs):
        for impl in guarded:
            if impl.fallback_ok(*args, **kwargs):
                return impl.fn(*args, **kwargs)
        return last.fn(*args, **kwargs)

    return call


class KernelTable:
    """Every op of one backend, as attributes: ``kernels.rms_norm(x, w, eps)``."""

    def __init__(self, backend: str, impls: Iterable[KernelImpl], force_reference: bool | None = None):
        if force_reference is None:
            force_reference = _forced_reference()
        self.backend = backend
        self.force_reference = force_reference
        by_op: dict[str, list[KernelImpl]] = {
            op: [KernelImpl(op, fn, REFERENCE, priority=-(10**9), plugin="mtcore")]
            for op, fn in REFERENCE_OPS.items()
        }
        for impl in impls:
            check_signature(impl)
            by_op[impl.op].append(impl)
        self._dispatchers = {op: OpDispatcher(op, c, force_reference) for op, c in by_op.items()}
        for op, dispatcher in self._dispatchers.items():
            setattr(self, op, dispatcher)

    def __getitem__(self, op: str) -> OpDispatcher:
        return self._dispatchers[op]

    def ops(self) -> list[str]:
        return list(self._dispatchers)

    def table(self, query: KernelQuery) -> dict[str, list[KernelImpl]]:
        """Which implementations serve each op for ``query`` (for ``mtcore doctor``)."""
        return {op: d.select(query) for op, d in self._dispatchers.items()}


def _forced_reference() -> bool:
    value = os.environ.get(KERNELS_ENV, "").strip()
    if value in ("", "auto"):
        return False
    if value == REFERENCE:
        return True
    raise ValueError(f"{KERNELS_ENV}={value!r} is not understood; use 'reference' or 'auto'")
