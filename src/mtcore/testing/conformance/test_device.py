"""Device contract: placement, sync, streams and events, memory, RNG, autocast, capabilities."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from mtcore.backend import Availability, DeviceCapabilities
from mtcore.testing.conformance.plugin import CAPABILITY

_ALLOC_BYTES = 64 * 2**20
# How far a peak may still rise after the blocks are freed: a host device's peak is the
# process's resident high-water mark, which also counts the pages that reading it touches
# (seen: one 4 KiB page, in a loaded run). A peak that follows the current usage falls by
# the freed 112 MiB instead.
_PAGE_SLACK_BYTES = 64 * 2**10


def test_type(backend, device):
    assert isinstance(backend.device.type, str) and backend.device.type, (
        "Device.type must be a non-empty str"
    )
    assert device.type == backend.device.type, (
        f"torch_device() is {device}, Device.type is {backend.device.type!r}"
    )
    assert torch.empty(1, device=device).device.type == backend.device.type


def test_availability(backend):
    available = backend.device.availability()
    assert isinstance(available, Availability), (
        f"availability() returned {type(available).__name__}"
    )
    assert available.ok, f"the selected backend says it cannot run: {available.reason}"


def test_device_count(backend):
    count = backend.device.device_count()
    assert isinstance(count, int) and count >= 1, (
        f"device_count() = {count!r}, expected an int >= 1"
    )


def test_set_and_current_device(backend):
    dev = backend.device
    start = dev.current_index()
    assert 0 <= start < dev.device_count(), (
        f"current_index() {start} outside [0, {dev.device_count()})"
    )
    try:
        for index in range(min(dev.device_count(), 2)):
            dev.set_device(index)
            assert dev.current_index() == index, (
                f"set_device({index}) left current_index() at {dev.current_index()}"
            )
            assert backend.torch_device().index in (None, index)
    finally:
        dev.set_device(start)
    with pytest.raises((ValueError, RuntimeError, AssertionError)):
        dev.set_device(dev.device_count() + 7)
    dev.set_device(start)


def test_synchronize(backend, device):
    x = torch.ones(256, 256, device=device)
    y = x @ x
    backend.device.synchronize()
    assert y[0, 0].item() == 256.0


def test_streams_and_events(backend, device):
    dev = backend.device
    stream = dev.stream()
    assert stream is not None, "stream() returned None"
    x = torch.full((1000,), 2.0, device=device)
    with dev.use_stream(stream):
        y = x * 3
    event = dev.event()
    if event is None:
        dev.synchronize()
        assert torch.all(y == 6.0)
        pytest.skip(f"{CAPABILITY} event() returned None (no events on this device)")
    event.record()
    event.synchronize()
    assert event.query(), "event.query() is False after event.synchronize()"
    dev.synchronize()
    assert torch.all(y == 6.0)


def test_memory_stats(backend, device):
    dev = backend.device
    dev.synchronize()
    dev.reset_peak_memory_stats()
    before = dev.memory_allocated()
    assert isinstance(before, int) and before >= 0, f"memory_allocated() = {before!r}"
    block = torch.ones(_ALLOC_BYTES // 4, device=device)
    dev.synchronize()
    during, peak = dev.memory_allocated(), dev.max_memory_allocated()
    assert isinstance(during, int) and isinstance(peak, int), "memory stats must be ints"
    assert during - before >= _ALLOC_BYTES // 2, (
        f"allocating {_ALLOC_BYTES} bytes raised memory_allocated() by only {during - before}"
    )
    assert peak >= during, f"max_memory_allocated() {peak} < memory_allocated() {during}"
    del block
    dev.empty_cache()
    dev.synchronize()
    dev.reset_peak_memory_stats()
    current = dev.memory_allocated()
    after_reset = dev.max_memory_allocated()
    assert after_reset >= current, f"after reset, peak {after_reset} < current {current}"
    assert after_reset <= peak - _ALLOC_BYTES // 2, (
        f"reset_peak_memory_stats() after freeing {_ALLOC_BYTES} bytes left the peak at "
        f"{after_reset} (it was {peak})"
    )


def test_manual_seed_reproducible(backend, device):
    dev = backend.device
    dev.manual_seed(1234)
    a = torch.rand(1000, device=device)
    dev.manual_seed(1234)
    b = torch.rand(1000, device=device)
    dev.manual_seed(4321)
    c = torch.rand(1000, device=device)
    assert torch.equal(a, b), "manual_seed(s) twice gave different draws"
    assert not torch.equal(a, c), "different seeds gave the same draws"


def test_rng_state_round_trip(backend, device):
    dev = backend.device
    dev.manual_seed(7)
    state = dev.get_rng_state()
    assert isinstance(state, torch.Tensor), f"get_rng_state() returned {type(state).__name__}"
    a = torch.rand(1000, device=device)
    dev.set_rng_state(state)
    b = torch.rand(1000, device=device)
    assert torch.equal(a, b), "set_rng_state(get_rng_state()) did not replay the draws"


def test_fork_rng_restores(backend, device):
    dev = backend.device
    dev.manual_seed(11)
    state = dev.get_rng_state()
    expected = torch.rand(100, device=device)
    dev.set_rng_state(state)
    with dev.fork_rng():
        dev.manual_seed(999)
        torch.rand(100, device=device)
    assert torch.equal(dev.get_rng_state(), state), "fork_rng() did not restore the RNG state"
    assert torch.equal(torch.rand(100, device=device), expected), "draws after fork_rng() differ"


def test_autocast(backend, device):
    dtypes = backend.device.capabilities().dtypes
    low = [d for d in (torch.bfloat16, torch.float16) if d in dtypes]
    if not low:
        pytest.skip(f"{CAPABILITY} capabilities().dtypes lists no bfloat16 or float16")
    a = torch.randn(16, 32, device=device)
    b = torch.randn(32, 8, device=device)
    with backend.device.autocast(low[0]):
        y = a @ b
    assert y.dtype == low[0], f"matmul under autocast({low[0]}) gave {y.dtype}"
    with backend.device.autocast(low[0], enabled=False):
        z = a @ b
    assert z.dtype == torch.float32, f"autocast(enabled=False) still changed the dtype to {z.dtype}"


def test_capabilities(backend):
    caps = backend.device.capabilities()
    assert isinstance(caps, DeviceCapabilities), f"capabilities() returned {type(caps).__name__}"
    assert isinstance(caps.name, str) and caps.name, "capabilities().name must be a non-empty str"
    assert caps.dtypes and all(isinstance(d, torch.dtype) for d in caps.dtypes), (
        "dtypes must be torch.dtypes"
    )
    assert torch.float32 in caps.dtypes, "float32 must be among capabilities().dtypes"
    assert isinstance(caps.peak_tflops, Mapping), "peak_tflops must be a mapping"
    for key, value in caps.peak_tflops.items():
        assert isinstance(key, str) and isinstance(value, int | float) and value > 0, (
            f"peak_tflops[{key!r}] = {value!r}: keys are dtype names, values positive TFLOP/s"
        )
    assert caps.memory_bytes is None or (
        isinstance(caps.memory_bytes, int) and caps.memory_bytes > 0
    )
    cc = caps.compute_capability
    assert cc is None or (
        isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(v, int) for v in cc)
    )


def test_peak_memory_never_falls_until_reset(backend, device):
    """``max_memory_allocated`` is a high-water mark: it grows with each larger allocation,
    stays when memory is freed (within a few pages, ``_PAGE_SLACK_BYTES``), and only
    ``reset_peak_memory_stats`` lowers it."""
    dev = backend.device
    dev.synchronize()
    dev.reset_peak_memory_stats()
    peaks, blocks = [], []
    for size in (_ALLOC_BYTES // 8, _ALLOC_BYTES // 4, _ALLOC_BYTES // 2):
        blocks.append(torch.ones(size // 4, device=device))
        dev.synchronize()
        peaks.append(dev.max_memory_allocated())
    blocks.clear()
    dev.synchronize()
    peaks.append(dev.max_memory_allocated())
    assert peaks == sorted(peaks), f"the peak fell without a reset: {peaks}"
    assert peaks[2] - peaks[0] >= _ALLOC_BYTES // 4, f"the peak did not grow: {peaks}"
    assert peaks[3] - peaks[2] <= _PAGE_SLACK_BYTES, f"freeing memory moved the peak: {peaks}"
