"""Where the commands print, and how, on a terminal and anywhere else (a log file, a pipe, CI).

On a terminal: rich, as wide as the terminal. Anywhere else: no colour, no line wrapped inside
(a figure never splits from its unit), tables as wide as their content rather than squeezed into
80 columns. Every command prints its report through ``console()`` and its progress through
``console(stderr=True)``.
"""
from __future__ import annotations

from rich.console import Console

UNWRAPPED_WIDTH = 100_000
"""The width a non-terminal console lays out at: wide enough that nothing real wraps; tables do
not stretch to it (they are as wide as their cells)."""


def console(stderr: bool = False, quiet: bool = False) -> Console:
    """A console on stdout (the report) or stderr (progress, warnings); ``quiet`` prints nothing
    (a command whose ``--json`` replaces its text report)."""
    probe = Console(stderr=stderr, highlight=False, quiet=quiet)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, highlight=False, quiet=quiet, width=UNWRAPPED_WIDTH, soft_wrap=True)
