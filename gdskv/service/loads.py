"""Loads: a step's pages served from the host tier where it holds them, from the disk otherwise.

``KvService.load`` / ``load_many``, called by the connector workers when a step's loads start.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Optional, Sequence

from gdskv.copies import payload_nbytes, scatter, scatter_all, scatter_copies, scatter_many
from gdskv.hosttier import Borrowed, Reserved, keeps_page_cache_reads
from gdskv.transfer import LoadStatus, LoadVia, PageTransfer

log = logging.getLogger(__name__)

HIT_COPY_THREADS = min(16, os.cpu_count() or 1)
"""Threads one call copying a step's host-tier hits into plain host memory runs on (at most one
per MiB copied): one core's memcpy is far from a socket's memory bandwidth, and the step waits
for the copy. On a 16-core H200 host, hot 1 MiB loads into pinned pages ran at 17-20 GB/s on 4
threads, 25 on 8 and 32 on 16, where warm ones (from the page cache, on 16 threads) ran at 20."""
HOST_COPY_THREADS = 2
"""Threads that copy host-tier hits into pages that must first wait for the engine's stream, or
that live in device memory, a step's hits per task (hits into plain host memory are copied on
the caller's thread, or for asynchronous loads natively: ``KvService._hits_native``)."""
DiskLoad = tuple[int, bytes, list[Any], Optional[Reserved], Optional[LoadVia]]
"""A page ``load_many`` reads from the disk: its index in the step, key, segments, and the host
tier's buffer reserved for it with the ``LoadVia`` that asks the transfer to fill it (or None)."""


class Loads:
    """The load methods of ``KvService``, which holds their state (``gdskv.service.core``)."""

    def load(self, group: int, key: bytes, segments: Sequence[Any], ready: Optional[Any] = None,
             shard: Optional[int] = None) -> Optional["Future[LoadStatus]"]:
        """Read ``key``'s chunk of this shard (or of ``shard``, one of ``shards``) into a page's
        ``segments`` and verify it; the future's result is ``LoadStatus.LOADED`` only when the
        page holds exactly that KV. None when the service has no transfers (inactive store): the
        caller recomputes."""
        rank = self.spec.tp_rank if shard is None else shard
        transfer = self.transfers.get(rank)
        if transfer is None:
            return None
        return self.load_many(group, [(key, segments)], ready, shard)[0]

    def load_many(self, group: int, items: Sequence[tuple[bytes, Sequence[Any]]], ready: Optional[Any] = None,
                  shard: Optional[int] = None, background: bool = False) -> list[Optional["Future[LoadStatus]"]]:
        """``load`` for a step's pages of one layer group at once (``(key, segments)`` each, one
        ``ready`` for all), as the workers post them at ``start_load_kv``: host-tier hits into
        plain host memory are copied in one native call (``_hits_now``; device pages, or pages
        behind a ``ready``, in one task on a copy thread: ``_hits_after``), the rest go to the
        transfer as one batch (a few thread hand-offs, not one per page). One future per page,
        in order (a step's hits share one).
        ``background``: an asynchronous load, no forward pass waits for it: nothing is copied on
        the caller's thread; its hits into host memory are copied natively and finished by the
        ``reap`` between steps (``_hits_native``), its disk reads run on the background path."""
        rank = self.spec.tp_rank if shard is None else shard
        transfer = self.transfers.get(rank)
        if transfer is None:
            return [None] * len(items)
        t0 = time.perf_counter()
        nbytes = self.bytes_per_page(group)
        out: list[Optional[Future]] = [None] * len(items)
        disk: list[DiskLoad] = []
        now: list[tuple[int, bytes, Borrowed, list[Any]]] = []
        keys = [key for key, _ in items]
        segs = [list(segments) for _, segments in items]  # not a tuple a page (gc: see gdskv.futures)
        if self.host is None:
            disk = [(i, key, segments, None, None) for i, (key, segments) in enumerate(zip(keys, segs))]
        else:
            sizes = [payload_nbytes(segments) for segments in segs]
            lents = self._borrow_many(rank, group, keys, sizes)
            misses: list[int] = []
            later: list[tuple[int, bytes, Borrowed, list[Any]]] = []
            after: list[tuple[int, bytes, Borrowed, list[Any]]] = []
            for i, (key, segments, lent) in enumerate(zip(keys, segs, lents)):
                if lent is None:
                    misses.append(i)
                elif ready is None and all(s.is_cpu for s in segments):
                    (later if background else now).append((i, key, lent, segments))
                else:
                    after.append((i, key, lent, segments))
            self._hits_after(rank, after, ready, out, nbytes, t0)
            self._hits_after(rank, self._hits_native(rank, transfer, later, out, nbytes, t0), None, out, nbytes, t0)
            slots = self._reserve_many(rank, group, [keys[i] for i in misses], [sizes[i] for i in misses])
            disk = [(i, keys[i], segs[i], slot, None if slot is None else LoadVia(slot.buf, keeps_page_cache_reads(segs[i])))
                    for i, slot in zip(misses, slots)]
        if now:
            for i, key, segments in self._hits_now(rank, now, out, nbytes, t0):
                disk.append((i, key, segments, None, None))
        if not disk:
            return out
        with self._lock:
            self._inflight += len(disk)
            self._add({"loads_posted": len(disk)})

        def finished(done: list[int], results: Optional[list[Any]], skipped: list[int]) -> None:
            self._loads_finished(rank, group, [disk[k] for k in done], results, [disk[k] for k in skipped], nbytes, t0)

        futures = transfer.load_pages(group, [(key, segments, via) for _, key, segments, _, via in disk],
                                      ready=ready, on_done=finished, background=background)
        for (i, *_), fut in zip(disk, futures):
            out[i] = fut
        return out

    def _hits_now(self, rank: int, hits: list[tuple[int, bytes, Borrowed, list[Any]]], out: list[Optional[Future]],
                  nbytes: int, t0: float) -> list[tuple[int, bytes, list[Any]]]:
        """Host-tier hits into plain host memory with nothing to wait for, copied here, all at once
        (``scatter_many``: one native call on ``HIT_COPY_THREADS`` threads); they share one future,
        done (a hand-off would cost more than the copy). Returns the pages whose copy failed, for
        the disk."""
        failed: list[tuple[int, bytes, list[Any]]] = []
        try:
            scatter_many([(lent.buf, segments) for _, _, lent, segments in hits], HIT_COPY_THREADS, checked=True)
        except Exception:  # page by page instead, each failure read from the disk
            kept = []
            for hit in hits:
                try:
                    scatter(hit[2].buf, hit[3])
                    kept.append(hit)
                except Exception as e:
                    log.warning("gdskv: a host-tier hit could not be copied into its page: %s", e)
                    failed.append((hit[0], hit[1], hit[3]))
                    hit[2].release()
            hits = kept
        if not hits:
            return failed
        self.host.release_many([lent for _, _, lent, _ in hits])
        done: Future = Future()  # one resolved future for every hit: a future each cost more than a 256 KiB copy
        done.set_result(LoadStatus.LOADED)
        for i, _, _, _ in hits:
            out[i] = done
        self._count(loads_posted=len(hits))
        self._hits_loaded(rank, [lent for _, _, lent, _ in hits], nbytes, t0, finished=0)
        return failed

    def _hits_native(self, rank: int, transfer: PageTransfer, hits: list[tuple[int, bytes, Borrowed, list[Any]]],
                     out: list[Optional[Future]], nbytes: int, t0: float) -> list[tuple[int, bytes, Borrowed, list[Any]]]:
        """An asynchronous load's host-tier hits into plain host memory, copied on native threads
        (``PageTransfer.copy_later``) and finished, like its disk reads, by the ``reap`` between
        steps: one future for them all, no Python thread per page competing with the serving
        loop. Returns the hits that could not start that way (no native path), for
        ``_hits_after``."""
        if not hits:
            return hits
        k, lents = len(hits), [lent for _, _, lent, _ in hits]

        def done() -> None:
            self.host.release_many(lents)
            self._hits_loaded(rank, lents, nbytes, t0, finished=k)

        with self._lock:
            self._inflight += k
            self._add({"loads_posted": k})
        fut = transfer.copy_later(scatter_copies([(lent.buf, segments) for _, _, lent, segments in hits]), done)
        if fut is None:
            with self._lock:
                self._inflight -= k
                self._add({"loads_posted": -k})
            return hits
        for i, _, _, _ in hits:
            out[i] = fut
        return []

    def _hits_after(self, rank: int, hits: list[tuple[int, bytes, Borrowed, list[Any]]], ready: Optional[Any],
                    out: list[Optional[Future]], nbytes: int, t0: float) -> None:
        """A step's host-tier hits copied on a copy thread, after ``ready``, in one task: into
        device memory (every copy queued, then one wait per device: ``scatter_all``), into pages
        the engine's stream may still be using, or where no native path takes them. One future
        for them all, resolved once every byte is in its page; cancelled before the copy thread
        reached it, the hits' buffers go back and the pages count as failed."""
        if not hits:
            return
        k, lents = len(hits), [lent for _, _, lent, _ in hits]

        def copy() -> LoadStatus:
            try:
                if ready is not None:
                    ready.synchronize()
                scatter_all([(lent.buf, segments) for _, _, lent, segments in hits], HIT_COPY_THREADS)
            finally:
                self.host.release_many(lents)
            return LoadStatus.LOADED

        def count(f: Future) -> None:
            if f.cancelled():
                self.host.release_many(lents)
            if not f.cancelled() and f.exception() is None and f.result() is LoadStatus.LOADED:
                self._hits_loaded(rank, lents, nbytes, t0, finished=k)
                return
            self._observe("load", rank, k, t0)
            with self._lock:
                self._inflight -= k
                self._add({"loads_failed": k})

        with self._lock:
            self._inflight += k
            self._add({"loads_posted": k})
        try:
            fut = self._host_copies.submit(copy)
        except RuntimeError:  # shut down (close() raced this load)
            self.host.release_many(lents)
            fut = Future()
            fut.set_result(LoadStatus.MISSING)
        done = _counted(fut, count)
        for i, _, _, _ in hits:
            out[i] = done

    def _hits_loaded(self, rank: int, lents: list[Borrowed], nbytes: int, t0: float, finished: int) -> None:
        """Counts host-tier hits copied into their pages (``lents``, pages of ``nbytes``): the
        service's counters (``finished`` of them leaving the in-flight count) and the
        namespace's, and their latency since ``t0``. Called by every hit path once the bytes are
        in place."""
        k, size = len(lents), sum(lent.buf.numel() for lent in lents)
        with self._lock:
            self._inflight -= finished
            self._add({"loads_loaded": k, "bytes_loaded": k * nbytes, "host_hits": k, "host_hit_bytes": size})
        shared = self.namespaces[rank].counters
        shared.add("host_hits", k)
        shared.add("host_hit_bytes", size)
        self._observe("load", rank, k, t0)

    def _loads_finished(self, rank: int, group: int, done: list[DiskLoad], results: Optional[list[Any]],
                        skipped: list[DiskLoad], nbytes: int, t0: float) -> None:
        """A slice of disk loads finished (``PageTransfer``'s ``on_done``, on its thread, before the
        pages' futures resolve): its LOADED pages kept in the host tier (``_keep``; a reserved
        buffer only when the transfer copied the payload into it: not where the page cache served
        a page in host memory, ``keeps_page_cache_reads``); then the slice is counted at once.
        ``results`` is None when the slice raised."""
        oks = [results is not None and results[k] is LoadStatus.LOADED for k in range(len(done))]
        puts = self._keep(rank, group, [(key, segments, slot, ok and (via is None or via.copied))
                                        for (_, key, segments, slot, via), ok in zip(done, oks)],
                          [slot for _, _, _, slot, _ in skipped])
        loaded = sum(oks)
        finished = len(done) + len(skipped)
        self._observe("load", rank, finished, t0)
        self._count_puts(rank, puts, {"loads_loaded": loaded, "bytes_loaded": loaded * nbytes,
                                      "loads_failed": finished - loaded}, finished)


def _counted(fut: Future, count: Callable[[Future], None]) -> Future:
    """A future that resolves as ``fut`` does, once ``count(fut)`` has run: whoever sees a load or
    save done (``result()``, ``done()``, ``wait``) also sees the counters it moved. Cancelling it
    cancels ``fut`` where that has not started."""
    out: Future = Future()

    def relay(f: Future) -> None:
        try:
            count(f)
        finally:
            with contextlib.suppress(InvalidStateError):  # ``out`` was cancelled meanwhile
                if f.cancelled():
                    out.cancel()
                elif f.exception() is not None:
                    out.set_exception(f.exception())
                else:
                    out.set_result(f.result())

    out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)
    fut.add_done_callback(relay)
    return out
