"""A dependency-free progress bar for long runs."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``label  37/200 [#####.....] loss 2.134  5.1 it/s  eta 32s`` on one line.

    On a terminal the line is redrawn in place; otherwise (logs, CI) a line is
    printed at every 10% so output stays readable.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None, width: int = 24) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.done = 0
        self._last_decile = -1

    def update(self, loss: float) -> None:
        """Count one step and show its loss."""
        self.done += 1
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate else 0.0
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"{self.label:<22} {self.done:>5}/{self.total} [{bar}] loss {loss:6.3f} "
            f"{rate:5.1f} it/s  eta {eta:4.0f}s"
        )
        if self.tty:
            end = "\n" if self.done == self.total else ""
            self.stream.write("\r" + line + end)
            self.stream.flush()
            return
        decile = 10 * self.done // self.total
        if decile != self._last_decile or self.done == self.total:
            self._last_decile = decile
            self.stream.write(line + "\n")
            self.stream.flush()
