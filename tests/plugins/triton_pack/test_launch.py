"""The pack's launch parameters follow the target's warp size instead of assuming 32.

Triton on MUSA compiles with 128 threads per warp below arch 3.1, AMD's wave64
targets with 64. The threads per program stay what the kernels reason about;
only the warp count changes. These checks need no triton.
"""

from __future__ import annotations

import pytest

launch = pytest.importorskip("mtcore_triton.launch")


@pytest.mark.parametrize(
    ("block", "warps"),
    # block columns -> num_warps at warp sizes 32, 64, 128
    [
        (16, (1, 1, 1)),
        (256, (1, 1, 1)),
        (1024, (4, 2, 1)),
        (2048, (8, 4, 2)),
        (4096, (16, 8, 4)),
        (16384, (16, 8, 4)),
    ],
)
def test_norm_row_warps_hold_the_same_threads_at_every_warp_size(block, warps):
    got = tuple(launch.row_warps(block, warp) for warp in (32, 64, 128))
    assert got == warps
    # A 16384-wide row: 512 threads, 32 columns each, whatever the warp size.
    for warp, n in zip((32, 64, 128), got, strict=True):
        assert n * warp == min(max(block // 8, warp), 512)


def test_fixed_thread_counts_become_fewer_warps_on_wider_warps():
    assert [launch.num_warps(launch.DEFAULT_THREADS, w) for w in (32, 64, 128)] == [4, 2, 1]
    assert [launch.num_warps(launch.TILE_THREADS, w) for w in (32, 64, 128)] == [8, 4, 2]
    # Fewer threads than one warp still launch one whole warp.
    assert launch.num_warps(16, 32) == 1


def test_num_warps_refuses_nonsense():
    with pytest.raises(ValueError, match="positive"):
        launch.num_warps(0, 32)
    with pytest.raises(ValueError, match="positive"):
        launch.num_warps(128, 0)


def test_interpreter_switch_is_read_like_triton_reads_it():
    # The folder's conftest sets TRITON_INTERPRET=1; triton's knobs (or, before 3.4,
    # the variable itself) say the interpreter runs, which has no warp size: 32.
    assert launch.interpreting()
    assert launch.warp_size() == launch.INTERPRETER_WARP_SIZE == 32


class _MusaDriverStandIn:
    """What triton.runtime.driver.active answers on a node with an S4000 (arch 2.2) as
    device 0 and an S5000 (arch 3.1) as device 1; no MUSA device runs here."""

    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("musa", 22, 128) if self.device == 0 else GPUTarget("musa", 31, 32)


def test_compiled_launches_read_the_current_device_target(monkeypatch):
    runtime = pytest.importorskip("triton.runtime")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled, as on a device
    monkeypatch.setattr(launch, "_WARP_SIZES", {})
    stand_in = _MusaDriverStandIn()
    # The config's own fields, as they were: reading ``active`` would create the
    # default driver, which needs a GPU (triton 3.3 keeps ``active``, later ``_active``).
    saved = dict(vars(runtime.driver))
    runtime.driver.set_active(stand_in)
    try:
        assert not launch.interpreting()
        assert launch.warp_size() == 128
        assert launch.num_warps(launch.TILE_THREADS) == 2
        stand_in.device = 1
        assert launch.warp_size() == 32
        assert launch.row_warps(16384) == 16
    finally:
        vars(runtime.driver).clear()
        vars(runtime.driver).update(saved)
