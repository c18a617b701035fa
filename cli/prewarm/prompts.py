"""Prompt files for ``gdskv prewarm`` (and ``push``/``pull --prompts``): ``.txt`` paragraphs,
``.jsonl`` prompts or chat messages, or a directory of them, read into ``Prompt``s; a file that
cannot be read is a failed prompt, a path that is not a prompt source a usage problem."""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from gdskv import jsondoc
from gdskv.cli._common import UsageProblem


# --- prompts -------------------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt as read from a file: text or chat messages, or why it could not be read."""

    source: str  # "file.txt#3" (paragraph) or "file.jsonl:7" (line)
    text: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    error: Optional[str] = None


def _not_utf8(e: UnicodeDecodeError, base: int = 0) -> str:
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {base + e.start})"


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a plain file"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; ValueError (the reason, for a failed prompt) when it cannot be read. Only a
    regular file is opened, and without blocking: a FIFO named ``x.txt`` is refused, not waited on."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_file_kind(st.st_mode)})")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)  # what was opened: the path may have changed since the stat
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"not a regular file ({_file_kind(st.st_mode)})")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None


def _read_txt(path: Path) -> list[Prompt]:
    try:
        data = _read_bytes(path)
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is not prompt text
    except ValueError as e:  # UnicodeDecodeError included: a .txt that is not text is one failure
        return [Prompt(str(path), error=_not_utf8(e) if isinstance(e, UnicodeDecodeError) else str(e))]
    paragraphs = re.split(r"\n[ \t]*\n", text)
    return [Prompt(f"{path}#{i + 1}", text=p.strip()) for i, p in enumerate(p for p in paragraphs if p.strip())] or _empty(path)


def _empty(path: Path) -> list[Prompt]:
    return [Prompt(str(path), error="empty file: no prompt in it")]


def _read_jsonl(path: Path) -> list[Prompt]:
    """One prompt per non-blank line (split on ``\\n`` only). A line that is not UTF-8 fails alone;
    a file that is not UTF-8 and holds NUL bytes (binary, UTF-16) is one failure."""
    try:
        data = _read_bytes(path)
    except ValueError as e:
        return [Prompt(str(path), error=str(e))]
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if b"\0" in data:
            return [Prompt(str(path), error=_not_utf8(e))]
    if data.startswith(b"\xef\xbb\xbf"):
        data = b"   " + data[3:]  # a UTF-8 byte order mark: blanked, offsets unchanged
    out, offset = [], 0
    for n, raw in enumerate(data.split(b"\n"), 1):
        start, offset = offset, offset + len(raw) + 1
        src = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append(Prompt(src, error=_not_utf8(e, start)))
            continue
        if not line.strip():
            continue
        try:
            obj = jsondoc.loads(line)
        except ValueError as e:
            out.append(Prompt(src, error=f"not JSON: {e}"))
            continue
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append(Prompt(src, text=obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(isinstance(m, dict) and "content" in m for m in obj["messages"]):
            out.append(Prompt(src, messages=obj["messages"]))
        else:
            out.append(Prompt(src, error="needs a string 'prompt' or a non-empty list of 'messages' with 'role' and 'content'"))
    return out or _empty(path)


def read_prompts(paths: Sequence[str]) -> list[Prompt]:
    """Every prompt of the given files and directories, in order; a usage error for a path that does
    not exist, a file that is not ``.txt`` / ``.jsonl`` or a directory without any. A file that
    cannot be read (not a regular file, permission denied, not UTF-8) is a failed prompt."""
    out: list[Prompt] = []
    for raw in paths:
        p = Path(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(p).st_mode)
        except FileNotFoundError:
            raise UsageProblem(f"{p} does not exist") from None
        except OSError as e:
            out.append(Prompt(str(p), error=f"cannot read: {e.strerror or e}"))
            continue
        if is_dir:
            try:
                files = sorted(f for f in p.iterdir() if f.suffix in (".txt", ".jsonl"))
            except OSError as e:
                out.append(Prompt(str(p), error=f"cannot list the directory: {e.strerror or e}"))
                continue
            if not files:
                raise UsageProblem(f"{p} has no .txt or .jsonl files")
        else:
            files = [p]
        for f in files:
            if f.suffix == ".txt":
                out += _read_txt(f)
            elif f.suffix == ".jsonl":
                out += _read_jsonl(f)
            else:
                raise UsageProblem(f"{f}: prompt files are .txt (paragraphs) or .jsonl (prompt / messages per line)")
    return out
