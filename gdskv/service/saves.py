"""Saves: a step's pages published to the store, kept in the host tier where it has room.

``KvService.save`` / ``save_many``, called by the connector workers after a layer group's
layers; uploads to the remote tier follow a published save.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Optional, Sequence

from gdskv.copies import payload_nbytes
from gdskv.hosttier import Reserved
from gdskv.transfer import SaveStatus


class Saves:
    """The save methods of ``KvService``, which holds their state (``gdskv.service.core``)."""

    def save(self, group: int, key: bytes, parent: Optional[bytes], segments: Sequence[Any],
             ready: Optional[Any] = None, shard: Optional[int] = None) -> Optional["Future[SaveStatus]"]:
        """Publish a page of this shard (or of ``shard``, one of ``shards``) under ``key``
        (``parent``: the previous block's key, or None for block 0) unless it is stored already.
        The caller keeps the page unchanged until the future resolves. None when the service has
        no transfers."""
        rank = self.spec.tp_rank if shard is None else shard
        transfer = self.transfers.get(rank)
        if transfer is None:
            return None
        return self.save_many(group, [(key, parent, segments)], ready, shard)[0]

    def save_many(self, group: int, items: Sequence[tuple[bytes, Optional[bytes], Sequence[Any]]],
                  ready: Optional[Any] = None, shard: Optional[int] = None) -> list[Optional["Future[SaveStatus]"]]:
        """``save`` for a step's pages of one layer group at once (``(key, parent, segments)``
        each, one ``ready`` for all), as the workers post them after a group's layers: one batch
        for the transfer (a few thread hand-offs, not one per page). One future per page, in order."""
        rank = self.spec.tp_rank if shard is None else shard
        transfer = self.transfers.get(rank)
        if transfer is None:
            return [None] * len(items)
        pages = [(key, parent, list(segments)) for key, parent, segments in items]
        t0 = time.perf_counter()
        nbytes = self.bytes_per_page(group)
        # A save's tier slot, filled by the transfer in the pass that seals the page, evicts
        # entries only within the share of the tier that saves in flight may hold: beyond it, a
        # batch of writes would push out what loads are served from before a page of it is done.
        # A PUBLISHED page without a slot is copied in when done (``_keep``).
        slots: list[Optional[Reserved]] = [None] * len(pages)
        if self.host is not None:
            slots = self._reserve_many(rank, group, [key for key, _, _ in pages],
                                       [payload_nbytes(segments) for _, _, segments in pages], saving=True)
        entries = [(*page, slot) for page, slot in zip(pages, slots)]
        with self._lock:
            self._inflight += len(pages)
            self._add({"saves_posted": len(pages)})

        def finished(done: list[int], results: Optional[list[Any]], skipped: list[int]) -> None:
            self._saves_finished(rank, group, [entries[k] for k in done], results, [entries[k] for k in skipped],
                                 nbytes, t0)

        futures = transfer.save_pages(group, [(key, parent, segments, None if slot is None else slot.buf)
                                              for key, parent, segments, slot in entries], ready=ready, on_done=finished)
        if self.remote is None:
            return list(futures)
        out = [self.remote.after_save(transfer.ns, group, key, fut) for (key, _, _), fut in zip(pages, futures)]
        for fut in out:  # an upload's counters (on the namespace) are written by the next flush
            fut.add_done_callback(self._changed)
        return out

    def _saves_finished(self, rank: int, group: int,
                        done: list[tuple[bytes, Optional[bytes], list[Any], Optional[Reserved]]],
                        results: Optional[list[Any]],
                        skipped: list[tuple[bytes, Optional[bytes], list[Any], Optional[Reserved]]],
                        nbytes: int, t0: float) -> None:
        """A slice of saves finished (as ``_loads_finished``): its PUBLISHED pages kept in the
        host tier (write-through, ``_keep``); then the slice is counted at once."""
        statuses = [None if results is None else results[k] for k in range(len(done))]
        puts = self._keep(rank, group, [(key, segments, slot, status is SaveStatus.PUBLISHED)
                                        for (key, _, segments, slot), status in zip(done, statuses)],
                          [slot for *_, slot in skipped])
        published, existing = statuses.count(SaveStatus.PUBLISHED), statuses.count(SaveStatus.EXISTS)
        finished = len(done) + len(skipped)
        self._observe("save", rank, finished, t0)
        self._count_puts(rank, puts, {"saves_published": published, "bytes_saved": published * nbytes,
                                      "saves_existing": existing, "saves_dropped": finished - published - existing},
                         finished)
