"""Where the commands print, and how, on a terminal and anywhere else (a log file, a pipe, CI).

On a terminal: rich, as wide as the terminal. Anywhere else: no colour, no line wrapped inside
(a figure never splits from its unit), tables as wide as their content rather than squeezed into
80 columns. Every command prints its report through ``console()`` and its progress through
``console(stderr=True)``.

What a report prints comes from the store and the user (paths, file names, model names), so a
string is printed as it is: rich markup only where a print asks for it (``markup=True``, its
values escaped with ``rich.markup.escape``), never an emoji code, and control characters (a file
name's ``\\x1b[31m``) written as escapes a terminal does not act on.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

UNWRAPPED_WIDTH = 100_000
"""The width a non-terminal console lays out at: wide enough that nothing real wraps; tables do
not stretch to it (they are as wide as their cells)."""


def printable(text: str, keep: str = "") -> str:
    """``text`` with each character that is not printable (control characters, an undecodable
    byte's surrogate) but those in ``keep`` written as its escape (``\\x1b``, ``\\n``). Called by
    the report consoles for every string they print, and by ``gdskv.cli._common`` for error
    messages, which stay on one line."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class _Report(Console):
    """A console whose strings (printed, or in a table's cells and title) are shown as they are;
    built by ``console()``."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text, keep="\n\t"), **kwargs)


def console(stderr: bool = False, quiet: bool = False) -> Console:
    """A console on stdout (the report) or stderr (progress, warnings); ``quiet`` prints nothing
    (a command whose ``--json`` replaces its text report)."""
    plain: dict[str, Any] = {"stderr": stderr, "highlight": False, "markup": False, "emoji": False, "quiet": quiet}
    probe = _Report(**plain)
    if probe.is_terminal:
        return probe
    return _Report(**plain, width=UNWRAPPED_WIDTH, soft_wrap=True)
