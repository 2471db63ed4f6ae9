"""Activation recomputation: drop activations in forward, recompute them in backward.

Two granularities (Korthikanti et al. 2022, Megatron's ``recompute_granularity``):

* ``"full"``: checkpoint a whole transformer layer; only its input is kept.
* ``"selective"``: checkpoint only the attention core (``softmax(q k^T) v``),
  whose ``[b, heads, s, s]`` intermediates are the largest activations per
  FLOP; the linear layers keep theirs.

Both use ``torch.utils.checkpoint`` (``use_reentrant=False``). Recomputation
must reproduce the first forward exactly, dropout included, so the RNG is
restored through the backend, not through torch's own device guessing: the
default stream (``backend.device.get/set_rng_state``) and every stream of the
model-parallel ``RNGTracker`` are snapshotted when the checkpointed forward
starts, set back for the recompute, and returned to their current values after
it. The outer stream therefore advances exactly as it would without recompute:
``recompute="full"`` gives the same numbers as ``recompute="none"``. The
delayed FP8 scales of the linears inside ``fn`` (when it is a module) are
treated alike: the recompute quantizes with the scales its forward used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from mtcore.precision.fp8 import replay_delayed_scales, snapshot_delayed_scales

Recompute = Literal["none", "full", "selective"]
MODES = ("none", "full", "selective")


def checkpoint(fn: Callable, *args, backend, tracker=None, **kwargs):
    """``fn(*args, **kwargs)`` without keeping its activations; same numbers in backward.

    backend: the ``mtcore.backend.Backend`` (its device owns the default stream).
    tracker: the model's ``RNGTracker`` (None if ``fn`` draws from no tracked stream).
    """
    return _torch_checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,  # done below, through the backend
        context_fn=lambda: _rng_contexts(backend.device, tracker, fn),
        **kwargs,
    )


def _rng_contexts(device, tracker, fn=None):
    saved: dict[str, object] = {}

    @contextlib.contextmanager
    def forward():
        saved["default"] = device.get_rng_state()
        saved["tracked"] = tracker.get_states() if tracker is not None else None
        saved["fp8"] = snapshot_delayed_scales(fn) if isinstance(fn, nn.Module) else []
        yield

    @contextlib.contextmanager
    def recompute():
        now_default = device.get_rng_state()
        now_tracked = tracker.get_states() if tracker is not None else None
        device.set_rng_state(saved["default"])
        if tracker is not None:
            tracker.set_states(saved["tracked"])
        try:
            with replay_delayed_scales(saved["fp8"]):
                yield
        finally:
            device.set_rng_state(now_default)
            if tracker is not None:
                tracker.set_states(now_tracked)

    return forward(), recompute()


def check_mode(mode: str) -> Recompute:
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]
