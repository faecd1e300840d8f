"""Progress of a demo run: a ``rich`` progress bar on a terminal, plain lines elsewhere.

On a terminal (as ``rich`` decides it: a TTY, or ``FORCE_COLOR`` /
``TTY_COMPATIBLE`` set) the bar is redrawn in place with the step's loss,
the rate and the time left. Elsewhere (a log file, a pipe, CI) ``rich``
would draw nothing until the end, so a plain line is written at every 10%
of the run instead::

    fp8 + checkpointing      20/200 ( 10%) loss  2.134   5.1 it/s  eta 35s
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

__all__ = ["Progress"]


class Progress:
    """Progress of ``total`` steps labelled ``label``, written to ``stream`` (default stderr).

    Use as a context manager (the bar is closed on exit, also on an error),
    and call :meth:`update` once per step.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None) -> None:
        self.label, self.total = label, max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self._console = Console(file=self.stream)
        self.tty = self._console.is_terminal
        self.start = time.perf_counter()
        self.done = 0
        self._last_decile = 0
        self._bar: RichProgress | None = None
        if self.tty:
            self._bar = RichProgress(
                TextColumn("{task.description:<22}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]}"),
                TaskProgressColumn(),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._bar.add_task(label, total=self.total, loss="  -   ", rate="")
            self._bar.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def update(self, loss: float) -> None:
        """Count one step and show its loss."""
        self.done += 1
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:6.3f}", rate=f"{rate:5.1f} it/s")
            if self.done >= self.total:
                self.close()
            return
        decile = 10 * self.done // self.total
        if decile > self._last_decile or self.done == self.total:
            self._last_decile = decile
            eta = (self.total - self.done) / rate if rate else 0.0
            self.stream.write(
                f"{self.label:<22} {self.done:>5}/{self.total} ({100 * self.done // self.total:>3}%) "
                f"loss {loss:6.3f} {rate:5.1f} it/s  eta {eta:.0f}s\n"
            )
            self.stream.flush()

    def close(self) -> None:
        """Stop redrawing the bar (leaving it on screen); nothing to do for plain lines."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
