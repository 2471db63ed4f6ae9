"""Model-parallel random streams (Megatron's RNG tracker, through ``backend.device``).

Two streams, and the rule for which one a dropout must use:

* **default** (the device's ordinary generator), seeded ``seed + 100 * pp_rank``:
  the same on every tp rank (and every dp rank) of a pipeline stage. Use it for
  anything applied to a tensor that is *replicated* over tp: embedding and
  hidden dropout without sequence parallel. Replicas must stay identical; a
  different mask per tp rank would silently make the "replicated" activations
  differ and the ranks would train different models.
* **"tensor-parallel"** (this tracker), seeded ``seed + 2718 + tp_rank``:
  different on every tp rank. Use it for dropout on a tensor that is *sharded*
  over tp: attention probabilities of the local heads, and, under sequence
  parallel, hidden/embedding dropout on the local sequence shard (Megatron
  forks this stream around the whole transformer stack when SP is on). Each
  rank holds a different part of the tensor, so the same stream would give
  every part the same mask: correlated dropout across heads or positions.

Consequence: with dropout > 0, tp/sp runs draw other masks than one process
(whose single stream covers the whole tensor), so equivalence with one process
holds for dropout = 0; with dropout > 0 what must hold is the rule above and
"recompute gives the same masks as the first forward" (``recompute``).

The tracker is an explicit object (no module global), owned by the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

TP_STREAM = "tensor-parallel"
TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


class RNGTracker:
    """Named RNG streams of one device, switched in and out with ``fork``."""

    def __init__(self, device):
        self.device = device  # a ``mtcore.backend.Device``
        self._states: dict[str, Tensor] = {}
        self._seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` at ``seed``; the current streams are untouched."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another stream")
        self._states[name] = _state_for_seed(self.device, seed)
        self._seeds.add(seed)

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, Tensor]:
        """A snapshot (copies) of every stream, for recompute and checkpoints."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is untouched."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was not added; known: {self.names()}")
        outer = self.device.get_rng_state()
        self.device.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self.device.get_rng_state()
            self.device.set_rng_state(outer)


def model_parallel_seed(seed: int, layout, backend) -> RNGTracker:
    """Seed the default stream and return a tracker with the tensor-parallel stream.

    Call on every rank with the same ``seed``. The default stream gets
    ``seed + 100 * pp_rank`` (equal over tp and dp), the tracker's
    "tensor-parallel" stream ``seed + 2718 + tp_rank`` (different over tp).
    """
    default_seed = seed + PP_SEED_STRIDE * layout.pp_rank
    backend.device.manual_seed(default_seed)
    tracker = RNGTracker(backend.device)
    tracker.add(TP_STREAM, seed + TP_SEED_OFFSET + layout.tp_rank)
    return tracker


def _state_for_seed(device, seed: int) -> Tensor:
    """The state ``device.manual_seed(seed)`` gives, leaving every generator as it was.

    ``manual_seed`` may reseed the host generator too (it does on accelerator
    devices), so the host state is saved and restored along with the device's.
    """
    host, outer = torch.get_rng_state(), device.get_rng_state()
    try:
        device.manual_seed(seed)
        return device.get_rng_state()
    finally:
        device.set_rng_state(outer)
        torch.set_rng_state(host)
