"""What the MAX connector reports: MAX's ``KVCacheMetrics`` per batch, lifetime counters, and the
store's occupancy (``disk_byte_count``).

The counts are MAX's units: a block is a leaf block (however many TP shards' chunks it took), a
load or offload counts once it settled, and a load that failed counts no bytes. (The service's
own counters, ``KvService.counters``, count chunks.)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gdskv.connectors.max.types import ByteCount, KVCacheMetrics
from gdskv.eviction import disk_usage, scan_store
from gdskv.service import KvService

log = logging.getLogger(__name__)


@dataclass
class GdsKvMetrics(KVCacheMetrics):
    """MAX's ``KVCacheMetrics`` plus the block counts gdskv keeps.

    MAX's cache manager adds a connector's metrics into its own; the extra fields stay readable
    on the connector's own answer. ``load_failures`` counts loads whose copy failed as this
    connector saw them; MAX's ``connector_load_failures`` is left to the cache manager, which
    counts the same event itself.
    """

    blocks_read: int = 0
    blocks_written: int = 0
    load_failures: int = 0


@dataclass
class Counts:
    """Event counts: one instance per ``take_metrics`` window and one for the lifetime."""

    blocks_read: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    offload_blocks_skipped: int = 0
    offload_blocks_dropped: int = 0
    loads: int = 0
    loads_refused: int = 0
    load_failures: int = 0
    lookups: int = 0
    touches: int = 0

    def add(self, **deltas: int) -> None:
        for k, v in deltas.items():
            setattr(self, k, getattr(self, k) + v)


class Meter:
    """The connector's counts: a window ``take`` reads and clears, the lifetime totals (``stats``,
    kept in ``stats_file`` when one is named) and the disk operations in flight. Thread-safe."""

    def __init__(self, stats_file: Optional[str] = None) -> None:
        self.stats_file = stats_file
        self._lock = threading.Lock()
        self._write_mu = threading.Lock()
        self._window = Counts()
        self._total = Counts()
        self._inflight = 0

    def count(self, inflight: int = 0, **deltas: int) -> None:
        """Add event counts to the window and the lifetime totals, and ``inflight`` to the disk
        operations in flight, in one step."""
        with self._lock:
            self._inflight += inflight
            self._window.add(**deltas)
            self._total.add(**deltas)

    def settled(self, jobs: int, **counts: int) -> None:
        """A transfer's last job finished (on an I/O thread): count it and keep ``stats_file``
        current, since a serving worker may never exit cleanly."""
        self.count(inflight=-jobs, **counts)
        self.write()

    def metrics(self) -> GdsKvMetrics:
        with self._lock:
            return self._as_metrics(self._window)

    def take(self) -> GdsKvMetrics:
        """The window's metrics, clearing it (``inflight_disk_ops`` is a level, not cleared)."""
        with self._lock:
            out = self._as_metrics(self._window)
            self._window = Counts()
            return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dataclasses.asdict(self._total) | {"inflight_disk_ops": self._inflight}

    def write(self, path: Optional[str] = None) -> None:
        """Write ``stats()`` as JSON to ``path`` (default: ``stats_file``), atomically; a no-op
        without a path."""
        path = path or self.stats_file
        if not path:
            return
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with self._write_mu:  # one writer at a time: the newest counters land last
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(tmp).write_text(json.dumps(self.stats() | {"pid": os.getpid()}, indent=1))
                os.replace(tmp, path)
        except OSError as e:
            log.warning("gdskv: could not write connector stats to %s: %s", path, e)

    def _as_metrics(self, c: Counts) -> GdsKvMetrics:
        return GdsKvMetrics(
            disk_bytes_read=c.bytes_read,
            disk_bytes_written=c.bytes_written,
            inflight_disk_ops=self._inflight,
            connector_loads_refused=c.loads_refused,
            connector_offload_blocks_dropped=c.offload_blocks_dropped,
            blocks_read=c.blocks_read,
            blocks_written=c.blocks_written,
            load_failures=c.load_failures,
        )


class Occupancy:
    """The store's chunk bytes against its capacity, for ``disk_byte_count``.

    The byte budget's running count when one is set; else the last background scan's
    (``scan_store`` on ``background``), rescanned at most every ``stats_flush_seconds``; the
    latest measurement is returned at once, never waited for."""

    def __init__(self, service: KvService, background: Executor) -> None:
        self.service = service
        self._background = background
        self._lock = threading.Lock()
        self._used = 0
        self._measured_at = float("-inf")
        self._refreshing = False
        self.closed = False

    def byte_count(self) -> ByteCount:
        """The budget's bytes when one is set (free also bounded by the file system), else what
        is used plus what the file system has free; ``ByteCount(0, 0)`` without a store."""
        store, cfg = self.service.store, self.service.cfg
        if store is None:
            return ByteCount(free=0, total=0)
        budget = store.budget
        used = getattr(budget, "used_bytes", None)  # gdskv.eviction.Budget keeps a running count
        if used is None:
            used = self._scanned()
        try:
            fs_free = disk_usage(str(store.root))[1]
        except OSError:
            fs_free = 0
        if cfg.max_bytes is not None:
            total = cfg.max_bytes
            return ByteCount(free=max(0, min(total - used, fs_free)), total=total)
        return ByteCount(free=fs_free, total=used + fs_free)

    def _scanned(self) -> int:
        with self._lock:
            stale = time.monotonic() - self._measured_at > self.service.cfg.stats_flush_seconds
            if not stale or self._refreshing or self.closed:
                return self._used
            self._refreshing = True
        try:
            self._background.submit(self._scan)
        except RuntimeError:  # shut down
            self._refreshing = False
        return self._used

    def _scan(self) -> None:
        try:
            self._used = scan_store(self.service.store, with_parents=False).total_bytes
            self._measured_at = time.monotonic()
        finally:
            self._refreshing = False
