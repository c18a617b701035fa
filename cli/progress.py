"""Progress of long work (``prewarm``, ``verify``, ``evict``, ``bench``): a rich bar on a terminal
(done of total, rate, time left), and where stderr is not a terminal (cron, a log, CI) one status
line every ``every`` seconds, the first after ``every`` seconds, so short runs print none.

``detail`` (optional) is called from the ticker thread to describe work inside the current item
(a long prompt's blocks so far): progress shows within seconds even while one item takes minutes.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gdskv.cli.output import console, printable

DEFAULT_EVERY = 10.0
"""Seconds between status lines off a terminal (``gdskv --status-every``)."""
MAX_EVERY = 86400.0
"""The longest ``--status-every``: a day (a timer's wait refuses infinity)."""


def status_every(ctx: Optional[click.Context]) -> float:
    """The global ``--status-every`` of the command's context (``DEFAULT_EVERY`` without one)."""
    obj = (ctx.find_root().obj if ctx is not None else None) or {}
    return float(obj.get("status_every", DEFAULT_EVERY))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Work:
    """One command's progress over ``total`` items of ``unit`` (e.g. 12 prompts). Use as a
    context manager; ``advance`` after each item. ``bar=False`` (``--json`` on a terminal) keeps
    the terminal free of a bar; status lines off a terminal still go to stderr."""

    def __init__(self, name: str, total: int, unit: str, every: float = DEFAULT_EVERY, bar: bool = True,
                 detail: Optional[Callable[[], str]] = None) -> None:
        self.name, self.total, self.unit, self.every = name, total, unit, every
        self.detail = detail
        self.done = 0
        self.err = console(stderr=True)
        self.terminal = self.err.is_terminal
        self._progress: Optional[Progress] = None
        if self.terminal and bar:
            # markup=False: the detail names a prompt file, whose path may hold '[' (a closing tag to rich)
            self._progress = Progress(TextColumn(name, markup=False), BarColumn(), MofNCompleteColumn(), TextColumn(unit, markup=False),
                                      TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), TimeElapsedColumn(),
                                      TextColumn("{task.fields[detail]}", markup=False), console=self.err)
            self._task = self._progress.add_task(name, total=total, rate="", detail="")
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None
        self._t0 = time.monotonic()

    def __enter__(self) -> "Work":
        self._t0 = time.monotonic()
        if self._progress is not None:
            self._progress.start()
        if self._progress is not None or not self.terminal:
            self._ticker = threading.Thread(target=self._tick, name=f"gdskv-{self.name}-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._progress is not None:
            self._progress.stop()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._progress is not None:
            self._progress.update(self._task, advance=n, rate=self._rate())

    def _rate(self) -> str:
        elapsed = time.monotonic() - self._t0
        return f"{self.done / elapsed:.1f}/s" if elapsed > 0 and self.done else ""

    def _describe(self) -> str:
        try:
            return printable(self.detail()) if self.detail is not None else ""
        except Exception as e:  # a progress line must never break the work it reports on
            return f"({type(e).__name__})"

    def line(self) -> str:
        """The status line: ``prewarm: 3/10 prompts (30%), 0.4/s, 17s left, 2m05s so far; <detail>``."""
        elapsed = time.monotonic() - self._t0
        parts = [f"{self.name}: {self.done}/{self.total} {self.unit}"]
        if self.total:
            parts[0] += f" ({self.done / self.total:.0%})"
        if self.done and elapsed > 0:
            rate = self.done / elapsed
            parts.append(f"{rate:.2f} {self.unit}/s")
            parts.append(f"{_duration((self.total - self.done) / rate)} left")
        parts.append(f"{_duration(elapsed)} so far")
        detail = self._describe()
        return ", ".join(parts) + (f"; {detail}" if detail else "")

    def _tick(self) -> None:
        every = self.every if self._progress is None else min(self.every, 0.5)
        while not self._stop.wait(every):
            if self._progress is not None:
                self._progress.update(self._task, detail=self._describe(), rate=self._rate())
            else:
                self.err.print(self.line(), markup=False, highlight=False)
