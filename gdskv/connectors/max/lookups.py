"""MAX's presence questions: ``lookup`` / ``probe`` masks, ``start_lookup`` handles, the leases a
``load`` takes and the recency ``touch`` refreshes.

A mask says, per leaf and position, whether every TP shard that stores the leaf holds the block
(``gdskv.planner.held_everywhere`` over ``KvService.held``). A ``start_lookup`` asks the same
with leases: what it reports is leased in the store (``KvService.lease_seconds``, respected by
eviction in every process), so nothing it found is evicted before ``load_lookup`` or
``abandon_lookup`` takes the handle, for up to ``LOOKUP_LEASE_SECONDS``. A handle nobody takes is
dropped by ``expire`` (MAX's ``poll_transfers``) once that time has passed.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from gdskv.connectors.max.memory import Pools
from gdskv.planner import held_everywhere
from gdskv.service import KvService

log = logging.getLogger(__name__)

LOOKUP_LEASE_SECONDS = 30.0
"""How long the chunks a ``start_lookup`` (or a ``load``) found stay leased against eviction, and
how long a handle that neither ``load_lookup`` nor ``abandon_lookup`` takes is kept."""


@dataclass(eq=False)
class GdsKvLookup:
    """The handle ``GdsKvConnector.start_lookup`` returns; MAX polls ``is_complete`` and reads
    ``result()``, then passes it to ``load_lookup`` or ``abandon_lookup``."""

    keys: list[bytes]
    replica_idx: int
    deadline: float
    _future: Optional["Future[dict[str, list[bool]]]"] = field(default=None, repr=False)
    _held: int = field(default=0, repr=False)
    _released: bool = field(default=False, repr=False)
    _mu: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def is_complete(self) -> bool:
        """Whether the answer is in. Never blocks."""
        return self._future is not None and self._future.done()

    def result(self) -> dict[str, list[bool]]:
        """The masks ``lookup`` would return; waits for the answer."""
        assert self._future is not None
        return self._future.result()

    @property
    def pinned(self) -> int:
        """How many chunks this handle holds leased for the load that follows (0 once released:
        the store's leases then simply run out)."""
        with self._mu:
            return self._held

    def _hold(self, chunks: int) -> None:
        """Hold ``chunks`` leased chunks, unless the handle was already released."""
        with self._mu:
            if not self._released:
                self._held = chunks

    def _release(self) -> None:
        with self._mu:
            self._released = True
            self._held = 0


class Lookups:
    """The presence side of one connector: masks, and the ``start_lookup`` handles not yet taken
    (answered on two background threads). Thread-safe."""

    def __init__(self, service: KvService, pools: Pools) -> None:
        self.service = service
        self.pools = pools
        self._live: set[GdsKvLookup] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="gdskv-max-lookup")

    def masks(self, keys: list[bytes], lease: bool = False) -> dict[str, list[bool]]:
        """One positional mask per leaf: which of ``keys`` every shard storing the leaf holds
        (and, with ``lease``, now holds leased)."""
        svc = self.service
        deadline = svc.lookup_deadline()  # one for the whole lookup, every leaf and shard
        return {leaf: held_everywhere(keys, [partial(svc.held, self.pools.gid[leaf], shard=s, lease=lease, deadline=deadline)
                                             for s in self.pools.store_shards(leaf)])
                for leaf in self.pools.leaves}

    def lease_chunks(self, chunks: list[tuple[str, bytes, int]]) -> Optional[tuple[str, bytes, int]]:
        """Lease the ``(leaf, key, shard)`` chunks a load reads; the first one not stored, or None."""
        asked: dict[tuple[str, int], list[bytes]] = {}
        for leaf, key, shard in chunks:
            asked.setdefault((leaf, shard), []).append(key)
        deadline = self.service.lookup_deadline()
        got = {(leaf, shard): iter(self.service.held(self.pools.gid[leaf], keys, shard, lease=True, deadline=deadline))
               for (leaf, shard), keys in asked.items()}
        for leaf, key, shard in chunks:
            if not next(got[(leaf, shard)]):
                return leaf, key, shard
        return None

    def touch(self, keys: list[bytes]) -> None:
        """Refresh the recency of ``keys`` (root first) in every leaf and shard that stores it."""
        for leaf, gid in self.pools.gid.items():
            for shard in self.pools.store_shards(leaf):
                self.service.touch(gid, keys, shard)

    def start(self, keys: list[bytes], replica_idx: int) -> GdsKvLookup:
        """A handle answered on a lookup thread, its chunks leased; ``RuntimeError`` once closed."""
        handle = GdsKvLookup(keys, replica_idx, time.monotonic() + LOOKUP_LEASE_SECONDS)
        with self._lock:
            self._live.add(handle)
        handle._future = self._pool.submit(self._answer, handle)
        return handle

    def _answer(self, handle: GdsKvLookup) -> dict[str, list[bool]]:
        masks = self.masks(handle.keys, lease=True)
        handle._hold(sum(sum(m) * len(self.pools.store_shards(leaf)) for leaf, m in masks.items()))
        return masks

    def release(self, handle: object) -> None:
        """Drop a handle (ours or not, answered or not, twice: all fine). Never raises."""
        try:
            if isinstance(handle, GdsKvLookup):
                handle._release()
                with self._lock:
                    self._live.discard(handle)
        except Exception:  # never into the scheduler
            log.exception("gdskv: abandon_lookup failed")

    def expire(self) -> None:
        """Drop the handles whose time is up. Cheap; never raises."""
        try:
            now = time.monotonic()
            with self._lock:
                expired = [h for h in self._live if h.deadline < now]
            for h in expired:
                self.release(h)
        except Exception:
            log.exception("gdskv: poll_transfers failed")

    def close(self) -> None:
        """Release every handle, wait for the lookups in flight, release what answered since."""
        with self._lock:
            live = list(self._live)
        for h in live:
            self.release(h)
        self._pool.shutdown(wait=True)
        for h in live:
            self.release(h)
