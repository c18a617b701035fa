"""The service's counters: this process's (``ServiceCounters``), the store's shared ones, the metrics.

``KvService`` counts every lookup, load and save here; ``flush_stats`` writes the store's
per-process counter file that ``gdskv stats`` sums.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from gdskv.hosttier import Put


@dataclass
class ServiceCounters:
    """What this process's service did (``snapshot()`` for a plain dict)."""

    lookups: int = 0
    lookup_tokens: int = 0
    matched_tokens: int = 0
    lease_replans: int = 0
    """Lookups planned again because a chunk was gone by the time it was leased."""
    loads_posted: int = 0
    loads_loaded: int = 0
    loads_failed: int = 0
    bytes_loaded: int = 0
    saves_posted: int = 0
    saves_published: int = 0
    saves_existing: int = 0
    saves_dropped: int = 0
    bytes_saved: int = 0
    host_hits: int = 0
    """Loads served from the host tier (also counted in ``loads_loaded`` / ``bytes_loaded``)."""
    host_misses: int = 0
    """Loads the host tier (when on) did not hold, posted to the disk."""
    host_hit_bytes: int = 0
    host_fills: int = 0
    """Pages copied into the host tier: published by a save, or verified by a load from disk."""
    host_fill_bytes: int = 0
    host_evictions: int = 0
    host_evicted_bytes: int = 0


class Counting:
    """The counting methods of ``KvService``, which holds their state (``gdskv.service.core``)."""

    @property
    def in_flight(self) -> int:
        """Transfers posted and not finished."""
        with self._lock:
            return self._inflight

    def _changed(self, _: Any = None) -> None:
        """Counters moved outside ``_add`` (the remote tier's, on the namespace): ``flush_stats``
        writes them next time."""
        with self._lock:
            self._dirty = True

    def _count(self, **n: int) -> None:
        with self._lock:
            self._add(n)

    def _add(self, n: dict[str, int]) -> None:
        for name, v in n.items():
            setattr(self.counters, name, getattr(self.counters, name) + v)
        self._dirty = True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.counters)

    def flush_stats(self, force: bool = False) -> None:
        """Write the store's counter file of this process when something changed, at most every
        ``stats_flush_seconds``, and at once when nothing is in flight (or ``force``)."""
        if self.store is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and self.in_flight and now - self._last_flush < self.cfg.stats_flush_seconds:
            return
        self._dirty = False
        self._last_flush = now
        self.store.flush_stats()

    def _observe(self, op: str, rank: int, pages: int, t0: float) -> None:
        """``pages`` of ``op`` took since ``t0`` (the latency histogram, where metrics are on)."""
        if self.metrics is not None:
            took = time.perf_counter() - t0
            for _ in range(pages):
                self.metrics.observe(op, self.namespaces[rank], took)

    def _count_puts(self, rank: int, puts: list[tuple[Put, int]], counts: dict[str, int], finished: int) -> None:
        """A finished slice's counts and its pages' host-tier puts (``(put, bytes)``), counted at
        once: the service's counters under one lock, the namespace's shared ones once per name."""
        taken = [(put, size) for put, size in puts if put.taken]
        evicted = sum(put.evicted for put, _ in puts)
        if taken:
            counts.update(host_fills=len(taken), host_fill_bytes=sum(size for _, size in taken))
        if evicted:
            counts.update(host_evictions=evicted, host_evicted_bytes=sum(put.evicted_bytes for put, _ in puts))
        with self._lock:
            self._inflight -= finished
            self._add(counts)
        shared = self.namespaces[rank].counters
        if taken:
            shared.add("host_fills", len(taken))
        if evicted:
            shared.add("host_evictions", evicted)
            shared.add("host_evicted_bytes", counts["host_evicted_bytes"])
