"""Run the Triton kernel pack on CPU tensors through Triton's interpreter.

``triton.jit`` decides between compiling and interpreting when a kernel is
decorated, i.e. when its module is imported, so the switch is set here, before
any test module of this directory imports the pack. ``test_runs_in_interpreter``
checks that it took effect. It stays set for the rest of the session (and its
subprocesses): triton also reads it while an interpreted kernel runs.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
