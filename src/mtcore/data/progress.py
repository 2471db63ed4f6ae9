"""Progress of the long data steps (tokenizing a corpus), for the person waiting on them.

The library stays silent by default (tests, notebooks, ranks); a command turns the
reports on with ``report_to(sys.stderr)``. On a terminal the report is one line
rewritten in place; otherwise (a log file, CI) a line every ``interval_s`` seconds,
so a log does not fill with carriage returns.
"""

from __future__ import annotations

import time
from typing import TextIO

_stream: TextIO | None = None


def report_to(stream: TextIO | None) -> None:
    """Send progress reports to ``stream`` (None: silence them)."""
    global _stream
    _stream = stream


def reporting() -> bool:
    return _stream is not None


class Progress:
    """Counts documents, tokens and bytes of one task and reports them now and then."""

    def __init__(self, task: str, total_bytes: int | None = None, interval_s: float = 5.0):
        self.task, self.total_bytes = task, total_bytes
        self.docs = self.tokens = self.bytes = 0
        self.start = self._last = time.perf_counter()
        self.stream = _stream
        tty = self.stream is not None and getattr(self.stream, "isatty", lambda: False)()
        self.tty, self.interval_s = tty, (0.2 if tty else interval_s)
        self._written = False

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def update(self, docs: int, tokens: int, nbytes: int = 0) -> None:
        self.docs, self.tokens, self.bytes = (
            self.docs + docs,
            self.tokens + tokens,
            self.bytes + nbytes,
        )
        now = time.perf_counter()
        if self.stream is not None and now - self._last >= self.interval_s:
            self._last = now
            self._write(self.line(), final=False)

    def line(self) -> str:
        """``task: 42.0% | documents, tokens | MB/s, tokens/s | elapsed, ETA``."""
        s = max(self.seconds, 1e-9)
        done = eta = ""
        if self.total_bytes:
            done = f"{min(100.0, 100 * self.bytes / self.total_bytes):5.1f}% | "
            left = max(self.total_bytes - self.bytes, 0)
            eta = f", ETA {_duration(left * s / self.bytes)}" if self.bytes else ", ETA ?"
        return (
            f"{self.task}: {done}{self.docs:,} documents, {self.tokens:,} tokens | "
            f"{self.bytes / s / 1e6:.1f} MB/s, {self.tokens / s:,.0f} tokens/s | "
            f"{_duration(s)}{eta}"
        )

    def summary(self) -> str:
        return (
            f"{self.task}: {self.docs:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s"
        )

    def close(self) -> str:
        """Write (when reporting) and return the summary line."""
        text = self.summary()
        if self.stream is not None:
            self._write(text, final=True)
        return text

    def _write(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    """``42 s``, ``3m05s`` or ``2h07m``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def say(text: str) -> None:
    """One line to the progress stream, when there is one."""
    if _stream is not None:
        print(text, file=_stream, flush=True)
