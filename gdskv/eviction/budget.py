"""Eviction budget: the capacity hook ``PageTransfer`` calls on ``store.budget``.

``Budget`` implements ``admit`` / ``on_published`` / ``pin`` / ``unpin``; ``install_budget(store,
cfg)`` sets it at bring-up when the config has a byte budget or a free-space floor.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter, deque
from typing import Callable, Optional

from gdskv.config import GdsKvConfig
from gdskv.eviction.index import chunk_index_of, scan_store
from gdskv.eviction.policy import (
    NO_PARENT,
    ChunkTable,
    Limits,
    _norm,
    select_victims,
    shortfall,
)
from gdskv.eviction.removal import remove_chunks
from gdskv.store import Namespace, PageStore

log = logging.getLogger(__name__)

INFLIGHT_TTL_S = 60.0
"""How long ``Budget`` counts an admitted save that has not published (it may have failed)."""

DiskUsage = Callable[[str], tuple[int, int]]


def disk_usage(path: str) -> tuple[int, int]:
    """``(size, free bytes)`` of the file system holding ``path`` (free: what a non-root user
    can still write). ``Budget``'s default probe; also used by ``gdskv info`` / ``evict``."""
    u = shutil.disk_usage(path)
    return u.total, u.free


def _allocation_unit(path: str) -> int:
    """The file system's allocation unit (``f_frsize``): what a file's size is rounded up to."""
    try:
        return max(1, os.statvfs(path).f_frsize)
    except OSError:
        return 4096


class Budget:
    """The capacity hook ``PageTransfer`` calls through ``store.budget``.

    ``admit`` before every save (after the chunk was found absent), ``on_published`` after the
    rename, ``pin``/``unpin`` around every load. The store's chunk bytes are estimated between
    scans (scan result + bytes admitted since); a scan happens when the estimate says a save does
    not fit, and at least every ``rescan_seconds`` so that other processes' writes are seen. An
    eviction frees what the save needs plus ``headroom`` (a fraction of the budget, or of the
    floor when only a floor is set), so one scan serves many saves. A save that does not fit
    while another thread evicts waits at most ``max_wait_seconds`` for it, then is dropped.
    ``disk_usage``, ``clock`` and ``block_size`` (the allocation unit the floor counts in) are
    injectable for tests.
    """

    def __init__(self, store: PageStore, limits: Limits, headroom: float = 0.05, rescan_seconds: float = 300.0,
                 max_wait_seconds: float = 2.0, disk_usage: DiskUsage = disk_usage, clock: Callable[[], float] = time.monotonic,
                 block_size: Optional[int] = None) -> None:
        self.store = store
        self.limits = limits
        self.headroom = headroom
        self.rescan_seconds = rescan_seconds
        self.max_wait_seconds = max_wait_seconds
        self.disk_usage = disk_usage
        self.clock = clock
        self._used: Optional[int] = None  # chunk bytes on disk: last scan + published since
        self._inflight: deque[tuple[float, int]] = deque()  # (admitted at, bytes) not yet published
        self._inflight_bytes = 0
        self._inflight_blocks = 0  # the same saves in the file system's allocation units
        self._block = block_size or _allocation_unit(str(store.root))
        self._scanning = False
        self._published_while_scanning = 0
        self._scanned_at = float("-inf")
        self._state = threading.Lock()  # guards the fields below; held for microseconds
        self._evicting = threading.Lock()  # one scan / eviction at a time
        self._pins: Counter[str] = Counter()
        self._known: dict[tuple[str, int], dict[int, int]] = {}
        self._error_logged_at = float("-inf")

    @property
    def used_bytes(self) -> Optional[int]:
        """The current estimate of the store's chunk bytes, saves in flight included (None before
        the first scan)."""
        return None if self._used is None else self._used + self._inflight_bytes

    # hook -------------------------------------------------------------------------------------
    def admit(self, ns: Namespace, group: int, nbytes: int, parent: Optional[bytes] = None) -> bool:
        """May a chunk of ``nbytes`` be written now? Evicts first when it would cross a limit;
        False (the caller drops and counts the save) when not enough can be evicted, e.g.
        because everything left is pinned. The chunk's ``parent`` block (and so its ancestors)
        is not evicted to make room for it, and nothing is evicted for a chunk whose parent is
        not stored: either would leave the new chunk unservable. Never raises: a scan or an
        eviction that fails (I/O error, bad metadata) drops the save, with a log line and the
        namespace's ``eviction_errors`` counter.
        Called by ``PageTransfer._save`` on a transfer thread, never on the serving loop."""
        try:
            return self._admit(ns, group, nbytes, parent)
        except (OSError, ValueError) as e:
            ns.counters.add("eviction_errors")
            now = self.clock()
            if now - self._error_logged_at >= 60.0:  # at most one line a minute
                self._error_logged_at = now
                log.warning("gdskv: eviction in %s failed, save dropped: %s", self.store.root, e)
            return False

    def _admit(self, ns: Namespace, group: int, nbytes: int, parent: Optional[bytes]) -> bool:
        stale = self._used is None or self.clock() - self._scanned_at > self.rescan_seconds
        if stale and self._evicting.acquire(blocking=self._used is None):
            try:
                self.refresh()
            finally:
                self._evicting.release()
        if self._try_reserve(nbytes):
            return True
        if not self._evicting.acquire(timeout=self.max_wait_seconds):
            return False  # another thread is still making room: a late save is worth less than a free thread
        try:
            if self._try_reserve(nbytes):  # another thread evicted meanwhile
                return True
            if parent is not None and not ns.contains(group, parent):
                return False  # the chunk would be unservable: not worth evicting anything for
            table = self.refresh()
            need = self._need(nbytes)
            if need > 0:
                base = self.limits.max_bytes or self.limits.floor_bytes(self.disk_usage(str(self.store.root))[0])
                with self._state:
                    protect = list(self._pins) + ([ns.chunk_path(group, parent)] if parent is not None else [])
                pinned = table.rows_of(protect)
                rows = select_victims(table, need + int(self.headroom * base), pinned, now_ns=time.time_ns())
                done = remove_chunks(self.store, table, rows, lambda p: self._pins[_norm(p)] > 0, self._state)
                with self._state:
                    self._used = max(0, (self._used or 0) - done.freed_bytes)
                if done.removed:
                    log.info("gdskv: evicted %d chunks (%d bytes) to stay within %s", done.removed, done.removed_bytes, self.limits)
            return self._try_reserve(nbytes)
        finally:
            self._evicting.release()

    def on_published(self, ns: Namespace, group: int, key: bytes, parent: Optional[bytes], nbytes: int) -> None:
        """A chunk was renamed into place: remember its parent so the next scan does not read its
        trailer (its bytes were counted by ``admit``). Called by ``PageTransfer._save``."""
        p = int(NO_PARENT) if parent is None else chunk_index_of(ns.id, group, parent)
        with self._state:
            self._known.setdefault((ns.id, group), {})[chunk_index_of(ns.id, group, key)] = p
            for i, (_, n) in enumerate(self._inflight):
                if n == nbytes:
                    del self._inflight[i]
                    self._inflight_bytes -= n
                    self._inflight_blocks -= self._blocks(n)
                    break
            self._used = (self._used or 0) + nbytes
            if self._scanning:
                self._published_while_scanning += nbytes

    def pin(self, path: str) -> None:
        """A load of ``path`` starts: the chunk is not evicted until ``unpin``. Called by
        ``PageTransfer._load``."""
        path = _norm(path)
        with self._state:
            self._pins[path] += 1

    def unpin(self, path: str) -> None:
        """The load of ``path`` finished (whatever its outcome)."""
        path = _norm(path)
        with self._state:
            self._pins[path] -= 1
            if self._pins[path] <= 0:
                del self._pins[path]

    # internals --------------------------------------------------------------------------------
    def refresh(self) -> ChunkTable:
        """Rescan the store: the byte count, and the table the policy ranks. Called by ``admit``
        (when the estimate is stale or a save does not fit) and once by ``install_budget``."""
        with self._state:
            known = {k: dict(v) for k, v in self._known.items()}
            self._scanning, self._published_while_scanning = True, 0
        try:
            table = scan_store(self.store, known_parents=known)
        finally:
            with self._state:
                self._scanning = False
        with self._state:
            # a chunk published during the walk may or may not have been seen: count it (safe side)
            self._used = table.total_bytes + self._published_while_scanning
            self._scanned_at = self.clock()
            for k, v in known.items():  # now in the index cache
                for idx in v:
                    self._known.get(k, {}).pop(idx, None)
        return table

    def _need(self, nbytes: int) -> int:
        total, free = self.disk_usage(str(self.store.root)) if self.limits.has_floor else (0, 0)
        # saves in flight count as written, against the budget and against free space
        return shortfall(self.limits, (self._used or 0) + self._inflight_bytes, total,
                         free - self._inflight_blocks * self._block, nbytes, self._block)

    def _try_reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` as in flight if they fit. A reservation ends at ``on_published``, or
        after ``INFLIGHT_TTL_S`` (a save that failed after ``admit`` never publishes)."""
        with self._state:
            now = self.clock()
            while self._inflight and now - self._inflight[0][0] > INFLIGHT_TTL_S:
                n = self._inflight.popleft()[1]
                self._inflight_bytes -= n
                self._inflight_blocks -= self._blocks(n)
            if self._need(nbytes) > 0:
                return False
            self._inflight.append((now, nbytes))
            self._inflight_bytes += nbytes
            self._inflight_blocks += self._blocks(nbytes)
            return True

    def _blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block)


def install_budget(store: PageStore, cfg: GdsKvConfig) -> Optional[Budget]:
    """Set ``store.budget`` from the config's ``max_bytes`` / ``min_free_bytes`` /
    ``min_free_percent`` when any is set (scanning the store once), and return it; else None.

    Called once at bring-up by the connectors and the demo, right after ``PageStore.open``.
    """
    limits = Limits.of(cfg)
    if not limits.active:
        return None
    if isinstance(store.budget, Budget) and store.budget.limits == limits:
        return store.budget
    budget = Budget(store, limits)
    try:
        budget.refresh()
    except (OSError, ValueError) as e:  # bring-up goes on; the first ``admit`` scans again
        log.warning("gdskv: could not scan %s for its byte budget: %s", store.root, e)
    store.budget = budget
    return budget
