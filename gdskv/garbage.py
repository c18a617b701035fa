"""Crash leftovers: temp files of writers that died, and empty chunk directories.

Pure rules (``temp_file_is_stale``) plus the scan (``find_garbage``) and the removal
(``collect``). Called by ``gdskv gc`` and, in the background, by every connector's bring-up
(``collect_in_background``), so a crash's leftovers go away without anyone running a command.
Safe while other processes use the store: a temp file goes only when its writer is gone (its pid
is not alive on this host and it has not changed for ``min_age``) or it is older than ``grace``
whatever its pid (another host on a shared file system); ``rmdir`` never removes a directory that
has a file, and a writer whose directory vanished recreates it (``gdskv.transfer``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from gdskv import format as fmt
from gdskv.store import PRIVATE_DIR, PageStore

log = logging.getLogger(__name__)

DEFAULT_MIN_AGE_S = 60.0
DEFAULT_GRACE_S = 3600.0


def writer_pid(name: str) -> Optional[int]:
    """The pid a temp file name carries (``...tmp.<pid>`` or ``...tmp.<pid>.<rand>``), if any."""
    tail = name.rsplit(fmt.TMP_MARK, 1)[-1]
    head = tail.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (``temp_file_is_stale``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def file_age(st: os.stat_result, now: float) -> float:
    """Seconds since a file last changed: from its mtime, or, where that lies ahead (a clock that
    ran ahead, times copied with it), from its ctime, which no one but the kernel sets."""
    return now - (st.st_mtime if st.st_mtime <= now else st.st_ctime)


def temp_file_is_stale(name: str, age_s: float, min_age_s: float, grace_s: float) -> bool:
    """The removal rule for one temp file (pure apart from the pid probe)."""
    if age_s >= grace_s:
        return True
    pid = writer_pid(name)
    return age_s >= min_age_s and pid is not None and pid != os.getpid() and not pid_alive(pid)


@dataclass
class Garbage:
    """What ``find_garbage`` found to remove."""

    temp_files: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    empty_dirs: list[str] = field(default_factory=list)


def _private_temp_files(store: PageStore, rel: str = PRIVATE_DIR) -> Iterator[tuple[str, os.stat_result]]:
    """Temp-named regular files anywhere under ``.gdskv/`` (real directories only)."""
    for e in store.fs.scandir(rel, with_stat=True):
        if e.kind == "dir":
            yield from _private_temp_files(store, f"{rel}/{e.name}")
        elif e.kind == "file" and fmt.is_temp_name(e.name) and e.st is not None:
            yield store.fs.abspath(f"{rel}/{e.name}"), e.st


def find_garbage(store: PageStore, min_age_s: float, grace_s: float, now: Optional[float] = None) -> Garbage:
    """What ``gc`` would remove now: temp files in the arrays' chunk directories (of every
    array on disk, damaged namespaces included) and under ``.gdskv/``, and empty chunk
    directories. Walks the tree through ``store.fs``: links are never entered."""
    now = time.time() if now is None else now
    out = Garbage()
    temps: list[tuple[str, os.stat_result]] = []
    arrays = store.arrays()
    for array in arrays:
        temps += [(e.path, e.st) for e in store.chunk_entries(array)
                  if e.kind == "file" and e.st is not None and fmt.is_temp_name(e.name)]
    temps += list(_private_temp_files(store))
    for path, st in temps:
        if temp_file_is_stale(os.path.basename(path), file_age(st, now), min_age_s, grace_s):
            out.temp_files.append((path, st.st_size))
    for array in arrays:
        base = f"ns/{array.ns_id}/g{array.group}/c"
        for hi in store.fs.scandir(base, with_stat=True):
            if hi.kind != "dir" or not hi.name.isdigit() or hi.st is None:
                continue
            inside = store.fs.scandir(f"{base}/{hi.name}", with_stat=True)
            sub = next((e for e in inside if e.name == "0" and e.kind == "dir"), None)
            sub_gone = False
            if sub is not None and sub.st is not None and now - sub.st.st_mtime >= min_age_s \
                    and not store.fs.scandir(f"{base}/{hi.name}/0"):
                out.empty_dirs.append(store.fs.abspath(f"{base}/{hi.name}/0"))
                sub_gone = True
            if (not inside or (sub_gone and len(inside) == 1)) and now - hi.st.st_mtime >= min_age_s:
                out.empty_dirs.append(store.fs.abspath(f"{base}/{hi.name}"))
    return out


@dataclass
class Collected:
    """What ``collect`` removed, freed and failed to remove."""

    removed_temp_files: int = 0
    removed_dirs: int = 0
    freed_bytes: int = 0
    failed: int = 0


def collect(store: PageStore, garbage: Garbage) -> Collected:
    """Remove what ``find_garbage`` found, through ``store.fs`` (nothing outside the store);
    whatever changed meanwhile is left alone, and a removal that fails (read-only store) is
    counted, not raised."""
    out = Collected()
    for path, size in garbage.temp_files:
        try:
            store.fs.unlink(path)
            out.removed_temp_files += 1
            out.freed_bytes += size
        except FileNotFoundError:  # its writer finished (renamed it) or someone else collected it
            pass
        except OSError as e:
            out.failed += 1
            log.warning("gdskv: could not remove %s: %s", path, e)
    for d in garbage.empty_dirs:  # ``<hi>/0`` comes before ``<hi>``
        try:
            store.fs.rmdir(d)
            out.removed_dirs += 1
        except OSError:  # a writer put a file there meanwhile: keep it
            pass
    return out


def collect_in_background(store: PageStore) -> threading.Thread:
    """Clean crash leftovers (temp files only) without delaying bring-up. Never raises."""

    def run() -> None:
        try:
            garbage = find_garbage(store, DEFAULT_MIN_AGE_S, DEFAULT_GRACE_S)
            garbage.empty_dirs.clear()
            done = collect(store, garbage)
            if done.removed_temp_files:
                log.info("gdskv: removed %d temp files (%d bytes) left by crashed writers in %s",
                         done.removed_temp_files, done.freed_bytes, store.root)
        except Exception as e:  # a background thread of a server: log, never raise
            log.warning("gdskv: background cleanup of %s failed: %s", store.root, e)

    t = threading.Thread(target=run, name="gdskv-gc", daemon=True)
    t.start()
    return t
