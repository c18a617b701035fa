"""Read handles of chunk files kept open for a short while, so a hot chunk loaded again and
again is not reopened (and, under GDS, its cuFile handle not registered again) page after page.

Used by ``KvikioEngine`` for reads: every read still opens the chunk with ``open_data_file`` (no
link, no FIFO, a regular file inside the store) and looks the file up by ``(st_dev, st_ino)``;
only kvikio's own handle, its two opens and its cuFile registration, is reused. A chunk is
immutable once published (a new save is a new file, a rename), so an inode that is still open
is still the same chunk; quarantine and eviction rename or unlink it, and the next load opens
the new file under its new inode.

What a cached handle costs: the blocks of a chunk evicted meanwhile stay allocated until the
handle closes. That is bounded twice: at most ``capacity`` handles, none older than
``max_age`` seconds (a timer closes them while the engine is idle).
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

Key = tuple[int, int]


@dataclass
class Handle:
    """One open handle: ``users`` calls hold it now; ``retired`` ones close when the last lets go."""

    handle: Any
    key: Optional[Key]
    born: float
    users: int = 0
    retired: bool = False


class HandleCache:
    """An LRU of open read handles keyed by inode; one per ``KvikioEngine``.

    ``acquire`` returns a handle to use and ``release`` must follow it. ``opened`` counts handles made, ``reused``
    reads served by a handle already open (``gdskv info``-style counters for tests and
    benchmarks)."""

    def __init__(self, capacity: int = 64, max_age: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._lru: OrderedDict[Key, Handle] = OrderedDict()
        self._timer: Optional[threading.Timer] = None
        self._closed = False
        self.opened = 0
        self.reused = 0

    def acquire(self, fd: int, make: Callable[[], Any]) -> Handle:
        """A handle for the file open at ``fd`` (kept open by the caller until this returns):
        the cached one, else ``make()``'s (which must hold the file by itself: the caller closes
        ``fd`` afterwards)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            retired = self._expire_locked()
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                entry.users += 1
                self.reused += 1
        self._close_all(retired)
        if entry is not None:
            return entry
        entry = Handle(make(), key, self._clock(), users=1)
        with self._lock:
            self.opened += 1
            if self._closed or key in self._lru or self.capacity <= 0:
                entry.key = None  # another thread cached this file meanwhile: ours is used once
                return entry
            self._lru[key] = entry
            retired = []
            while len(self._lru) > self.capacity:
                retired.append(self._retire_locked(next(iter(self._lru))))
            self._arm_locked()
        self._close_all(retired)
        return entry

    def release(self, entry: Handle) -> None:
        """The caller is done with ``entry``; a retired or uncached one closes when unused."""
        with self._lock:
            entry.users -= 1
            close = entry.users == 0 and (entry.retired or entry.key is None)
        if close:
            entry.handle.close()

    def clear(self) -> None:
        """Close every handle (those in use when their call ends); the engine's ``close``."""
        with self._lock:
            self._closed = True
            retired = [self._retire_locked(k) for k in list(self._lru)]
            if self._timer is not None:
                self._timer.cancel()
        self._close_all(retired)

    def __len__(self) -> int:
        return len(self._lru)

    def _retire_locked(self, key: Key) -> Optional[Handle]:
        entry = self._lru.pop(key)
        entry.retired = True
        return entry if entry.users == 0 else None

    def _expire_locked(self) -> list[Optional[Handle]]:
        cutoff = self._clock() - self.max_age
        return [self._retire_locked(k) for k, e in list(self._lru.items()) if e.born <= cutoff]

    def _arm_locked(self) -> None:
        """Start the idle timer that closes expired handles, unless one is running."""
        if self._timer is None or not self._timer.is_alive():
            self._timer = threading.Timer(self.max_age, self._sweep)
            self._timer.daemon = True
            self._timer.start()

    def _sweep(self) -> None:
        with self._lock:
            retired = self._expire_locked()
            if self._lru and not self._closed:
                self._timer = threading.Timer(self.max_age / 2, self._sweep)
                self._timer.daemon = True
                self._timer.start()
        self._close_all(retired)

    @staticmethod
    def _close_all(entries: list[Optional[Handle]]) -> None:
        for entry in entries:
            if entry is not None:
                entry.handle.close()
