"""Helpers shared by the ``gdskv`` commands: opening the store, parsing sizes and durations, output.

Exit codes (every command): 0 ok, 1 something failed, 2 unusable input (bad option, or a path that is not a
gdskv store). ``UsageProblem`` carries the 2.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import click

from gdskv.cli.output import printable
from gdskv.config import ConfigError, GdsKvConfig, load_config, parse_size
from gdskv.store import Namespace, PageStore, StoreError, StoreUnreadable


STORE_HINT = "Pass --store PATH or set GDSKV_STORE."
"""The end of a usage problem about the store path."""


class UsageProblem(click.ClickException):
    """A usage error reported without the usage text (exit code 2)."""

    exit_code = 2


def config_of(ctx: click.Context) -> GdsKvConfig:
    """The config with the global ``--store`` applied (``GDSKV_CONFIG`` / ``GDSKV_STORE`` otherwise)."""
    try:
        return load_config(store_path=(ctx.obj or {}).get("store_path"))
    except ConfigError as e:
        raise UsageProblem(str(e)) from None


def open_existing(ctx: click.Context) -> tuple[GdsKvConfig, PageStore]:
    """The config and the store, which must already exist: every command but ``prewarm`` refuses
    to create one, and refuses a directory that is not a gdskv store (``PageStore.open`` checks)."""
    cfg = config_of(ctx)
    root = Path(cfg.store_path)
    try:
        return cfg, PageStore.from_config(cfg, create=False)
    except StoreUnreadable as e:
        raise click.ClickException(str(e)) from None
    except (StoreError, OSError) as e:
        raise store_refused(str(e) if os.path.exists(root) else f"{root} is not a gdskv store ({_absent(e)})") from None


def _absent(e: Exception) -> str:
    """Why ``open_existing`` found no store where none exists: it does not, or (an ``OSError``
    other than a missing path: a name too long for the file system) the system's reason."""
    if isinstance(e, OSError) and e.errno not in (None, errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        return e.strerror or str(e)
    return "it does not exist"


def store_refused(why: str) -> UsageProblem:
    """The usage problem of a store path the command will not use: ``why``, saying it is not
    touched (unless the store's own message says so already), and how to name another."""
    return UsageProblem(f"{why if 'refusing' in why else f'{why}; refusing to touch it'}. {STORE_HINT}")


def auth_key_of(cfg: GdsKvConfig) -> Optional[bytes]:
    """The config's chunk key (``auth_key_file`` / ``auth_key_env``), or a usage error naming the
    setting."""
    try:
        return cfg.auth_key()
    except ConfigError as e:
        raise UsageProblem(str(e)) from None


def select_namespaces(store: PageStore, wanted: Optional[str]) -> list[Namespace]:
    """All namespaces, or those whose id starts with ``wanted`` or whose model is ``wanted``."""
    every = store.namespaces()
    if wanted is None:
        return every
    chosen = [ns for ns in every if ns.id.startswith(wanted) or ns.spec.model == wanted]
    if not chosen:
        raise UsageProblem(f"no namespace matches {wanted!r} (have: {', '.join(ns.id for ns in every) or 'none'})")
    return chosen


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A float option's callback: ``value``, refused when it is not a number (``nan``, which no
    range check catches)."""
    if value != value:
        raise click.BadParameter(f"{value} is not a number", param=param)
    return value


def parse_duration(text: str) -> float:
    """``"7d"`` → seconds (units s, m, h, d, w; a bare number is seconds). A number of more digits
    than a float holds (``999...9w``, infinite) is refused, not passed on to overflow where the
    seconds are counted in ns. Called by ``ls``, ``evict`` and ``gc`` for their age options."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"not a duration: {text!r} (expected e.g. 90s, 30m, 12h, 7d, 2w)")
    seconds = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    if math.isinf(seconds):
        raise click.BadParameter(f"not a duration: {text!r} (too long to count)")
    return seconds


def parse_size_or_percent(text: str, fs_total: int) -> int:
    """``"500G"`` → bytes; ``"10%"`` → that share of the file system's size."""
    text = text.strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise click.BadParameter(f"not a percentage: {text!r}") from None
        if not 0 <= pct <= 100:
            raise click.BadParameter(f"a percentage must be in [0, 100]: {text!r}")
        return int(fs_total * pct / 100)
    try:
        return parse_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"`` (binary units up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def capacity_limits(cfg: GdsKvConfig) -> str:
    """The capacity limits the config sets, as a user wrote them (``max_bytes 8.0 MiB``), for the
    lines that say the limits refused or evicted something (``demo``, ``prewarm``)."""
    parts = [f"max_bytes {human_bytes(cfg.max_bytes)}" if cfg.max_bytes is not None else "",
             f"min_free_bytes {human_bytes(cfg.min_free_bytes)}" if cfg.min_free_bytes is not None else "",
             f"min_free_percent {cfg.min_free_percent:g}" if cfg.min_free_percent is not None else ""]
    return ", ".join(p for p in parts if p) or "no limit set: the disk was full"


def human_age(mtime_ns: int, now_ns: Optional[int] = None) -> str:
    """``"3m ago"``-style age of a wall-clock time in ns."""
    secs = max(0.0, ((now_ns or time.time_ns()) - mtime_ns) / 1e9)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.1f}{unit} ago"
    return f"{secs:.0f}s ago"


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


class OneLineErrors(click.Group):
    """The ``gdskv`` group: an error no command turned into a ``click`` error (an ``OSError`` from
    the store, a bug) is still one line on stderr and exit 1, never a traceback; ``-vv`` logs
    the traceback. A usage mistake (an unknown option, a bad value) is one line and exit 2 too,
    naming the command where click knows it, instead of click's usage block (``--help`` has it).
    A message that would still span lines (a path with a newline in it) has its control
    characters escaped."""

    def make_context(self, info_name: Optional[str], args: list[str], parent: Optional[click.Context] = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            raise _printable(_one_line_usage(e)) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _printable(_one_line_usage(e)) from None
        except click.ClickException as e:
            raise _printable(e)
        except (click.exceptions.Exit, click.Abort, KeyboardInterrupt, EOFError):
            raise
        except Exception as e:
            logging.getLogger("gdskv.cli").debug("gdskv %s failed", ctx.invoked_subcommand, exc_info=True)
            raise _printable(click.ClickException(f"{ctx.invoked_subcommand or 'gdskv'}: {one_line(e)}")) from None


def _printable(e: click.ClickException) -> click.ClickException:
    """``e`` with the control characters of its message escaped (``\\n``, ``\\x1b``): one line,
    nothing a terminal would act on."""
    e.message = printable(e.message)
    return e


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())
"""click >= 8.2 raises it for a bare group; older click prints the help itself."""


def _one_line_usage(e: click.UsageError) -> click.UsageError:
    """``e`` without its context, which is what makes click print the usage block: ``Error: gdskv
    info: No such option ...`` (exit 2). A bare ``gdskv`` keeps printing the help it asks for."""
    if e.ctx is None or isinstance(e, _NO_ARGS_IS_HELP):
        return e
    return click.UsageError(f"{e.ctx.command_path}: {e.format_message()}")


def one_line(e: BaseException) -> str:
    """An exception as one line: its message with whitespace collapsed, or its type's name; an
    ``OSError`` as ``strerror: path``."""
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    else:
        text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {text}"


class FailureReasons(logging.Handler):
    """The reasons of the failures a module logs as warnings, counted (the ``OSError`` each
    warning carries as its last argument: ``"Read-only file system"``), instead of a warning
    line per file."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        e = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        self.reasons[(e.strerror or str(e)) if isinstance(e, OSError) else record.getMessage()] += 1

    def summary(self) -> str:
        """``"Read-only file system"``, or the three commonest reasons with their counts."""
        common = self.reasons.most_common(3)
        return "; ".join(reason if len(self.reasons) == 1 else f"{reason} ({n})" for reason, n in common)


@contextmanager
def failures_logged(logger_name: str) -> Iterator[FailureReasons]:
    """Count what ``logger_name`` warns about while the block runs (``evict``, ``gc``)."""
    logger = logging.getLogger(logger_name)
    handler, propagate = FailureReasons(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
