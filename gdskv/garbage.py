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
from gdskv.store import PageStore

log = logging.getLogger(__name__)

DEFAULT_MIN_AGE_S = 60.0
DEFAULT_GRACE_S = 3600.0


def writer_pid(name: str) -> Optional[int]:
    """The pid a temp file name carries (``...tmp.<pid>`` or ``...tmp.<pid>.<rand>``), if any."""
    tail = name.rsplit(fmt.TMP_MARK, 1)[-1]
    head = tail.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def temp_file_is_stale(name: str, age_s: float, min_age_s: float, grace_s: float) -> bool:
    """The removal rule for one temp file (pure apart from the pid probe)."""
    if age_s >= grace_s:
        return True
    pid = writer_pid(name)
    return age_s >= min_age_s and pid is not None and pid != os.getpid() and not pid_alive(pid)


@dataclass
class Garbage:
    temp_files: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    empty_dirs: list[str] = field(default_factory=list)


def _temp_candidates(store: PageStore) -> Iterator[os.DirEntry]:
    """Every temp-named file in the arrays' chunk directories and under ``.gdskv/``."""
    dirs: list[str] = []
    for ns in store.namespaces():
        for g in ns.spec.groups:
            cdir = ns.array_path(g.layer_group_id) / "c"
            if cdir.is_dir():
                dirs += [f"{hi.path}/0" for hi in os.scandir(cdir) if hi.is_dir(follow_symlinks=False)]
    if store.private.is_dir():
        dirs += [str(p) for p in store.private.rglob("*") if p.is_dir() and not p.is_symlink()] + [str(store.private)]
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if fmt.is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                yield e


def find_garbage(store: PageStore, min_age_s: float, grace_s: float, now: Optional[float] = None) -> Garbage:
    """What ``gc`` would remove now."""
    now = time.time() if now is None else now
    out = Garbage()
    for e in _temp_candidates(store):
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if temp_file_is_stale(e.name, now - st.st_mtime, min_age_s, grace_s):
            out.temp_files.append((e.path, st.st_size))
    for ns in store.namespaces():
        for g in ns.spec.groups:
            cdir = ns.array_path(g.layer_group_id) / "c"
            for hi in os.scandir(cdir) if cdir.is_dir() else ():
                sub = f"{hi.path}/0"
                try:
                    if not os.listdir(sub) and now - os.stat(sub).st_mtime >= min_age_s:
                        out.empty_dirs.append(sub)
                    left = [n for n in os.listdir(hi.path) if not (n == "0" and out.empty_dirs[-1:] == [sub])]
                    if not left and now - os.stat(hi.path).st_mtime >= min_age_s:
                        out.empty_dirs.append(hi.path)
                except (FileNotFoundError, NotADirectoryError):
                    continue
    return out



@dataclass
class Collected:
    removed_temp_files: int = 0
    removed_dirs: int = 0
    freed_bytes: int = 0


def collect(garbage: Garbage) -> Collected:
    """Remove what ``find_garbage`` found; whatever changed meanwhile is left alone."""
    out = Collected()
    for path, size in garbage.temp_files:
        try:
            os.unlink(path)
            out.removed_temp_files += 1
            out.freed_bytes += size
        except FileNotFoundError:  # its writer finished (renamed it) or someone else collected it
            pass
    for d in garbage.empty_dirs:  # ``<hi>/0`` comes before ``<hi>``
        try:
            os.rmdir(d)
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
            done = collect(garbage)
            if done.removed_temp_files:
                log.info("gdskv: removed %d temp files (%d bytes) left by crashed writers in %s",
                         done.removed_temp_files, done.freed_bytes, store.root)
        except OSError as e:
            log.warning("gdskv: background cleanup of %s failed: %s", store.root, e)

    t = threading.Thread(target=run, name="gdskv-gc", daemon=True)
    t.start()
    return t
