"""The allow-listed unpickler admits Megatron-LM's ``exit_signal = signal.SIGTERM`` (in
every checkpoint Megatron-LM core_v0.16 writes) and nothing an enum-looking payload
could run: the class is never handed out, only a look-up of one plain value; other
calls, other members of the module and Enum's functional API stay refused. A payload
that would create a file is checked not to have created it."""

from __future__ import annotations

import argparse
import enum
import os
import re
import signal

import pytest
import torch

from mtcore.training.checkpoint import CheckpointError
from mtcore.training.checkpoint.safe_pickle import allowed_global, torch_file


class _Reduce:
    """Pickles as ``function(*args)``: what a hostile file can ask the unpickler to do."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _saved(tmp_path, payload):
    path = tmp_path / "common.pt"
    torch.save({"args": payload}, path)
    return path


def test_megatron_lm_s_exit_signal_loads_as_the_member(tmp_path):
    args = argparse.Namespace(exit_signal=signal.SIGTERM, params_dtype=torch.bfloat16,
                              signals=[signal.SIGINT, signal.SIGUSR1])  # fmt: skip
    loaded = torch_file(_saved(tmp_path, args))["args"]
    assert loaded.exit_signal is signal.SIGTERM and loaded.params_dtype is torch.bfloat16
    assert loaded.signals == [signal.SIGINT, signal.SIGUSR1]


def test_enum_looking_payloads_that_would_call_something_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    cases = {
        # Enum's functional API: Signals("Evil", "A B") would build a new class
        "refusing to call signal.Signals with ('Evil', 'A B')": _Reduce(
            signal.Signals, "Evil", "A B"
        ),
        # the member's value computed by a call: the inner call is refused first
        "refusing to unpickle posix.system": _Reduce(
            signal.Signals, _Reduce(os.system, f"touch {marker}")
        ),
        "refusing to call signal.Signals with (15.0,)": _Reduce(signal.Signals, 15.0),
        "signal.Signals has no member 999": _Reduce(signal.Signals, 999),
        # another callable of the same module: installs a handler
        "refusing to unpickle signal.signal": _Reduce(signal.signal, 15, signal.SIG_IGN),
        "refusing to unpickle enum.Enum": _Reduce(enum.Enum, "Evil", "A B"),
    }
    for message, payload in cases.items():
        with pytest.raises(CheckpointError, match=re.escape(message)):
            torch_file(_saved(tmp_path, argparse.Namespace(exit_signal=payload)))
    assert not marker.exists()
    # protocol 4 names attributes with dots: the class's own methods are not admitted
    for name in ("Signals.__new__", "Signals._convert_", "Signals.__class__", "signal"):
        assert allowed_global("signal", name) is None, name
    assert allowed_global("signal", "Signals") is not signal.Signals  # only its look-up
