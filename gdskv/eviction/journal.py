"""The chunk index's journals: what each process published, used and removed, appended as it
happens, so that no process has to walk the store to know what it holds.

Each process appends fixed-size records (``RECORD``, 64 bytes) to its own file,
``<root>/.gdskv/index/journal/<host>-<pid>-<start>-<seq>.log``, opened ``O_APPEND`` through
``store.fs``. No lock is taken and no record is ever rewritten: one ``write`` per batch, so a
process killed mid-write leaves at most a partial record at the very end of its own file, which
readers ignore (they read whole records only). A write that fails or comes up short closes the
file; the next batch starts a new one, so a partial record is never followed by more records.

Record kinds: ``PUBLISH`` (a chunk was renamed into place: its parent, size and exact mtime),
``TOUCH`` (a lookup set its mtime and lease), ``REMOVE`` (an evictor is about to rename it away;
stamped *before* the rename, so a save that publishes the block again afterwards wins),
``INTENT`` (a save is about to rename the chunk into place: its parent and size; see
``gdskv.eviction.intents``). ``at`` is the wall-clock time a record describes; the catalog
(``gdskv.eviction.catalog``) applies records in ``at`` order on top of its snapshot. Written by
``Budget`` (``on_publishing``, ``on_published``, ``on_touched``), ``remove_chunks`` and the
catalog's readers (an intent they settled); read by the catalog.

A writer holds an exclusive ``flock`` on the journal file it appends to for as long as it has it
open, so a journal whose lock is free belongs to a process that died (or gave the file up after a
failed write): what it announced with ``INTENT`` and never journaled as published is looked at
then (``intents.writer_alive``).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
import weakref
from typing import Optional

import numpy as np

from gdskv.store import PRIVATE_DIR, PageStore

log = logging.getLogger(__name__)

INDEX_DIR = "index"
JOURNAL_DIR = f"{PRIVATE_DIR}/{INDEX_DIR}/journal"
PUBLISH, TOUCH, REMOVE, INTENT = 1, 2, 3, 4

RECORD = np.dtype([("kind", "u1"), ("pad", "u1", (3,)), ("group", "<u4"), ("ns", "<u8"), ("index", "<u8"),
                   ("parent", "<u8"), ("nbytes", "<i8"), ("mtime", "<i8"), ("lease", "<i8"), ("at", "<i8")])
"""One journal record. ``ns``: the namespace id's 16 hex digits as a number; ``index``: the chunk
index in the array (``(hi << 50) | lo``); ``parent``: the parent's chunk index (``NO_PARENT``
none); ``mtime``/``lease``: the chunk file's mtime/atime as the record leaves them."""


def records(kind: int, ns_id: str, group: int, index: np.ndarray, parent: Optional[np.ndarray] = None,
            nbytes: Optional[np.ndarray] = None, mtime: Optional[np.ndarray] = None,
            lease: Optional[np.ndarray] = None, at: Optional[np.ndarray] = None) -> np.ndarray:
    """Records of one kind for chunks of one array (columns broadcast)."""
    out = np.zeros(np.size(index), dtype=RECORD)
    out["kind"], out["group"], out["ns"], out["index"] = kind, group, int(ns_id, 16), index
    out["parent"] = np.uint64(0xFFFF_FFFF_FFFF_FFFF) if parent is None else parent
    for name, col in (("nbytes", nbytes), ("mtime", mtime), ("lease", lease)):
        if col is not None:
            out[name] = col
    out["at"] = time.time_ns() if at is None else at
    return out


class Journal:
    """This process's journal of one store: ``append`` is thread-safe and never raises (a store
    that cannot take the record loses it; the catalog's walk heals what a lost record leaves out).
    One per store object (``journal_of``)."""

    def __init__(self, store: PageStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._pid = 0
        self._seq = 0
        self._start = time.time_ns()
        self._failed_at = float("-inf")
        self._end = 0  # bytes in the journal file now open

    def name(self) -> str:
        return f"{socket.gethostname()}-{os.getpid()}-{self._start}-{self._seq}.log"

    def _open(self) -> int:
        if self._fd is not None and self._pid == os.getpid():
            return self._fd
        if self._pid != os.getpid():  # a forked child writes its own journal
            self._fd, self._pid, self._start, self._seq = None, os.getpid(), time.time_ns(), 0
        self.store.fs.makedirs(JOURNAL_DIR)
        self._fd = self.store.fs.open(f"{JOURNAL_DIR}/{self.name()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        self._end = 0
        try:  # a reader's probe holds it shared for a moment at most
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:  # no locks here: readers wait out INTENT_TTL_S before they look at its intents
            pass
        return self._fd

    def append(self, recs: np.ndarray) -> Optional[tuple[str, int]]:
        """Append ``recs`` (``RECORD``) in one write: the journal's name and where they end in it
        (a reader that read that far has them: ``Budget``'s count), or None when they could not
        be written."""
        data = recs.tobytes()
        with self._lock:
            if recs.size == 0:
                return self.name(), self._end
            try:
                fd = self._open()
                if os.write(fd, data) == len(data):
                    self._end += len(data)
                    return self.name(), self._end
                raise OSError("short write to the chunk index journal")
            except OSError as e:
                self._close_locked()
                self._seq += 1
                now = time.monotonic()
                if now - self._failed_at > 60.0:
                    self._failed_at = now
                    log.warning("gdskv: could not journal %d chunk records in %s: %s", recs.size, self.store.root, e)
                return None

    def _close_locked(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


_journals: "weakref.WeakKeyDictionary[PageStore, Journal]" = weakref.WeakKeyDictionary()
_journals_lock = threading.Lock()


def journal_of(store: PageStore) -> Journal:
    """The one journal this process writes for ``store`` (made on first use)."""
    with _journals_lock:
        j = _journals.get(store)
        if j is None:
            j = _journals[store] = Journal(store)
        return j


def read_journals(store: PageStore, offsets: dict[str, int]) -> tuple[np.ndarray, dict[str, int]]:
    """Every whole ``PUBLISH``/``TOUCH``/``REMOVE`` record past ``offsets[name]`` in every
    journal, and the new offsets (``read_each``)."""
    each, ends = read_each(store, offsets)
    recs = np.concatenate(list(each.values())) if each else np.zeros(0, dtype=RECORD)
    return recs[np.isin(recs["kind"], (PUBLISH, TOUCH, REMOVE))], ends


def read_each(store: PageStore, offsets: dict[str, int]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per journal (by name, in name order), every whole record past ``offsets[name]``, of every
    kind; and the new offsets (whole records only: a partial record at a file's end is left for
    later, or for ever if its writer died). Links and other non-files among the journals are
    never opened. Called by the catalog, which needs to know whose ``INTENT`` records it reads."""
    parts: dict[str, np.ndarray] = {}
    ends: dict[str, int] = {}
    for e in sorted(store.fs.scandir(JOURNAL_DIR), key=lambda e: e.name):
        if e.kind != "file" or not e.name.endswith(".log"):
            continue
        start = offsets.get(e.name, 0)
        try:
            fd = store.fs.open_regular(f"{JOURNAL_DIR}/{e.name}")
        except (OSError, ValueError):
            continue
        try:
            size = os.fstat(fd).st_size
            end = size - size % RECORD.itemsize
            if start % RECORD.itemsize or start > end:
                start = end  # not a journal this catalog wrote offsets for: skip what is there
            buf = os.pread(fd, end - start, start) if end > start else b""
        except OSError:
            continue
        finally:
            os.close(fd)
        whole = len(buf) - len(buf) % RECORD.itemsize
        ends[e.name] = start + whole
        if whole:
            parts[e.name] = np.frombuffer(buf[:whole], dtype=RECORD)
    return parts, ends


def journal_ends(store: PageStore) -> dict[str, int]:
    """Each journal's length in whole records now: the offsets a walk that starts now includes."""
    return {e.name: e.st.st_size - e.st.st_size % RECORD.itemsize
            for e in store.fs.scandir(JOURNAL_DIR, with_stat=True) if e.kind == "file" and e.name.endswith(".log") and e.st is not None}
