"""Progress of long commands (probe, bench) on stderr: on a terminal one rich progress bar with
an estimate of the time left; otherwise the plain stage lines, one per stage (what scripts and
the tests read)."""

from __future__ import annotations

import sys
import threading
import time


class Stages:
    """Call with each stage's line. `total`: the expected seconds (`by_time`: the bar follows
    the clock, as probe's time budget does) or the number of steps (each `step()` advances it;
    rich estimates the rest from the pace so far)."""

    def __init__(self, total: float, by_time: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.by_time, self.total = by_time, total
        self.bar = None
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            self._start()

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
        if self.by_time:
            columns.append(TextColumn(f"of ~{self.total:.0f} s"))
        else:
            columns += [TextColumn("{task.completed:.0f}/{task.total:.0f}"), TimeRemainingColumn()]
        self.bar = Progress(*columns, console=Console(file=self.stream), transient=True)
        self.task = self.bar.add_task("", total=self.total)
        self.bar.start()
        if self.by_time:
            self.begin, self.done = time.monotonic(), threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.done.wait(0.2):
            elapsed = min(time.monotonic() - self.begin, self.total)
            self.bar.update(self.task, completed=elapsed)

    def __call__(self, line: str) -> None:
        if self.bar is None:
            print(line, file=self.stream)
        else:
            self.bar.update(self.task, description=line)

    def step(self, line: str) -> None:
        """A step done (bench: one run), with its line."""
        self(line)
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            if self.by_time:
                self.done.set()
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
