"""The engine-neutral KV cache service: one per process that serves an engine's KV from the store.

A connector (TensorRT-LLM, MAX, vLLM, ...) translates its engine's calls onto this object and holds
no policy of its own. The service owns:

- **bring-up** from a ``GdsKvConfig`` object and a ``NamespaceSpec`` (never from environment
  variables): ``PageStore.from_config``, one namespace per TP shard, the byte budget
  (``install_budget``), crash-leftover collection (``collect_in_background``), the I/O engine
  (``make_engine``) and a ``PageTransfer`` with the config's chunk key (``auth_key``);
- **lookup** of a request's chain of block keys across every layer group and every TP shard (the
  served prefix ends at the first block ordinal any group or shard misses: ``gdskv.planner``),
  with **leases** that eviction in any process respects; a lookup whose lease fails (a chunk
  evicted between the presence check and the lease) is planned again;
- **loads and saves** of pages (futures), of this process's own shard, through a **host tier**
  (``gdskv.hosttier``: ``host_bytes`` of verified pages in host memory, write-through on save,
  filled on loads that read the disk) in front of the disk;
- **lineage**: block keys chained on their parents (``keys``), the parent recorded with each save;
  for an engine that names blocks itself, links learnt from the runs it shows (``lineage``);
- **counters**: this process's outcomes (``counters``), and the store's per-process counter files
  that ``gdskv stats`` sums (``flush_stats``); with ``metrics_port`` set, the process's Prometheus
  endpoint and the latency of its lookups, loads and saves (``gdskv.metrics``);
- **close**.

A service built with ``transfers=False`` only looks up (a scheduler process that never touches
pages). Where the store cannot be used at all (``OSError``: full disk, read-only, removed) the
service is inactive: lookups find nothing, loads and saves are not posted, one log line says so.
A store path that is not a gdskv store, and a bad chunk key, fail bring-up (``ServiceSetupError`` /
``ConfigError``), naming the setting.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

from gdskv.config import GdsKvConfig
from gdskv.eviction import install_budget
from gdskv.garbage import collect_in_background
from gdskv.hosttier import (Borrowed, HostTier, Put, Reserved, TierConfigError, keeps_page_cache_reads,
                             payload_nbytes, scatter, scatter_all, scatter_copies, scatter_many, tier_bytes)
from gdskv.io import IoEngine, make_engine
from gdskv.keys import chain_keys
from gdskv.metrics import ServiceMetrics, attach, engine_of
from gdskv.planner import Lookup, Salt, contiguous_hits, lookup_needs, plan_lookup, plan_lookup_window_aware
from gdskv.remote import RemoteSetupError, RemoteTier
from gdskv.store import Namespace, NamespaceSpec, PageStore, StoreError
from gdskv.transfer import LoadStatus, LoadVia, PageTransfer, SaveStatus

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0
"""How long a lookup's served chunks are leased against eviction (in any process), so the load
that follows finds them."""
HIT_COPY_THREADS = min(16, os.cpu_count() or 1)
"""Threads one call copying a step's host-tier hits into plain host memory runs on (at most one
per MiB copied): one core's memcpy is far from a socket's memory bandwidth, and the step waits
for the copy. On a 16-core H200 host, hot 1 MiB loads into pinned pages ran at 17-20 GB/s on 4
threads, 25 on 8 and 32 on 16, where warm ones (from the page cache, on 16 threads) ran at 20."""
HOST_COPY_THREADS = 2
"""Threads that copy host-tier hits into pages that must first wait for the engine's stream, or
that live in device memory, a step's hits per task (hits into plain host memory are copied on
the caller's thread, or for asynchronous loads natively: ``KvService._hits_native``)."""
LINEAGE_CAPACITY = 1 << 16
"""How many ``block -> parent`` links ``KvService.lineage`` remembers."""
DiskLoad = tuple[int, bytes, list[Any], Optional[Reserved], Optional[LoadVia]]
"""A page ``load_many`` reads from the disk: its index in the step, key, segments, and the host
tier's buffer reserved for it with the ``LoadVia`` that asks the transfer to fill it (or None)."""


class ServiceSetupError(ValueError):
    """A configuration the service cannot serve, found at bring-up; the message names the setting."""


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


class KvService:
    """gdskv's KV cache service for one process of one deployment.

    ``spec`` describes this process's shard (its ``tp_rank`` among ``tp_size``); lookups check
    every shard's namespace (``spec.with_rank(r)``), loads and saves use this shard's. The KV
    heads are split evenly across TP ranks, so every shard has the same page geometry; a shard
    whose real geometry differed would have another namespace and simply miss.

    ``engine``: the I/O engine (default ``make_engine(cfg)``, then owned and closed by ``close``).
    ``shards``: the TP shards whose pages this process moves (``load``/``save``'s ``shard``);
    default its own, ``spec.tp_rank``. An engine that drives every shard from one process (MAX)
    names them all.
    """

    def __init__(self, cfg: GdsKvConfig, spec: NamespaceSpec, *, transfers: bool = True,
                 lease_seconds: float = LEASE_SECONDS, engine: Optional[IoEngine] = None,
                 shards: Optional[Sequence[int]] = None) -> None:
        if not isinstance(cfg, GdsKvConfig):
            raise TypeError(f"KvService needs a GdsKvConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.spec = spec
        self.lease_seconds = lease_seconds
        self.tokens_per_block = spec.tokens_per_block
        self.group_ids = [g.layer_group_id for g in spec.groups]
        self.windows = [g.window_size for g in spec.groups]
        self.counters = ServiceCounters()
        self._lock = threading.Lock()
        self._inflight = 0
        self._dirty = False
        self._last_flush = time.monotonic()
        self.store: Optional[PageStore] = None
        self.namespaces: list[Namespace] = []
        self.transfer: Optional[PageTransfer] = None
        """This shard's (``spec.tp_rank``)."""
        self.transfers: dict[int, PageTransfer] = {}
        self.engine: Optional[IoEngine] = None
        self._owns_engine = engine is None
        self.lineage = Lineage()
        self.remote: Optional[RemoteTier] = None
        """The shared tier (``[gdskv.remote]``): read-through at lookup, uploads after a save."""
        # ConfigError (naming the setting) at bring-up; the remote tier verifies what it fetches
        auth_key = cfg.auth_key() if transfers or cfg.remote is not None else None
        try:
            host_bytes = tier_bytes(cfg.host_bytes) if transfers else 0
        except TierConfigError as e:
            raise ServiceSetupError(str(e)) from None
        self.host: Optional[HostTier] = None
        """The host tier (None: ``host_bytes = 0``, or no transfers)."""
        self._host_copies: Optional[ThreadPoolExecutor] = None
        self.metrics: Optional[ServiceMetrics] = None
        """This process's metrics (``metrics_port`` set), labelled with the engine whose
        connector made the service (``gdskv.metrics.engine_of`` its module)."""
        engine_label = engine_of(sys._getframe(1).f_globals.get("__name__"))
        try:
            self.store = PageStore.from_config(cfg)
            self.namespaces = [self.store.namespace(spec.with_rank(r)) for r in range(spec.tp_size)]
            if transfers or cfg.remote is not None:  # a lookup-only service writes no chunk unless it reads through
                install_budget(self.store, cfg)
            collect_in_background(self.store)
        except StoreError as e:
            raise ServiceSetupError(f"gdskv: store_path {cfg.store_path}: {e}") from None
        except OSError as e:
            log.error("gdskv: store %s (store_path) is unusable: %s; serving nothing", cfg.store_path, e)
            self.namespaces = []
            return
        if transfers:
            self.engine = engine if engine is not None else make_engine(cfg)
            for r in (spec.tp_rank,) if shards is None else shards:
                self.transfers[r] = PageTransfer(self.namespaces[r], self.engine, threads=cfg.io_threads,
                                                 stats_flush_seconds=cfg.stats_flush_seconds, auth_key=auth_key,
                                                 background_nice=cfg.background_nice)
            self.transfer = self.transfers.get(spec.tp_rank)
            if host_bytes:
                self.host = HostTier(host_bytes)
                self._host_copies = ThreadPoolExecutor(max_workers=HOST_COPY_THREADS, thread_name_prefix="gdskv-host")
        if cfg.remote is not None:
            try:
                self.remote = RemoteTier(cfg.remote, auth_key, uploads=transfers, background_nice=cfg.background_nice)
            except RemoteSetupError as e:
                raise ServiceSetupError(str(e)) from None
            self.remote.start_leftovers([self.namespaces[r] for r in self.transfers])
        self.metrics = attach(self, engine_label)
        atexit.register(_flush_at_exit, weakref.ref(self))  # a process that ends without close() keeps its counts
        log.info("gdskv: service for %r shard %d/%d on namespace %s in %s%s", spec.model, spec.tp_rank, spec.tp_size,
                 self.namespace.id, cfg.store_path,
                 f" (I/O: {self.engine.describe()})" if self.engine is not None else " (lookups only)")

    # -- state ------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the store is usable (lookups can hit)."""
        return bool(self.namespaces)

    @property
    def namespace(self) -> Namespace:
        """This process's own shard (``spec.tp_rank``)."""
        return self.namespaces[self.spec.tp_rank]

    def bytes_per_page(self, group: int) -> int:
        return self.spec.group(group).bytes_per_page

    # -- lineage ----------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], cache_salt: Salt = None, start: int = 0,
             parent: Optional[bytes] = None) -> list[bytes]:
        """Keys of every full block of ``tokens`` from ordinal ``start`` on, each chained on its
        parent's (``parent`` is block ``start - 1``'s key) with ``cache_salt`` mixed in."""
        return chain_keys(tokens, self.tokens_per_block, cache_salt, start=start, parent=parent)

    # -- lookups ----------------------------------------------------------------------------------
    def stored(self, group: int, keys: Sequence[bytes], lease: bool = False) -> list[bool]:
        """For each key, whether every TP shard's chunk of it is in the store (layer group
        ``group``). A shard is asked only about keys the shards before it hold. ``lease``: lease
        what is found in the same pass (``Namespace.lease_many(present=True)``): a lookup's
        presence checks and leases cost one path walk per chunk, not two, and nothing can be
        evicted between the check and the lease."""
        if not self.active:
            return [False] * len(keys)
        present = [True] * len(keys)
        for ns in self.namespaces:
            todo = [i for i, p in enumerate(present) if p]
            if not todo:
                break
            asked = [keys[i] for i in todo]
            found = ns.lease_many(group, asked, self.lease_seconds, present=True) if lease else ns.contains_many(group, asked)
            for i, there in zip(todo, found):
                present[i] = there
        return present

    def _stored_dense(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        return self.stored(self.group_ids[index], keys)

    def _stored_leased(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        return self.stored(self.group_ids[index], keys, lease=True)

    def _lookup_stored(self) -> Callable[[int, Sequence[bytes]], list[bool]]:
        """What a lookup asks (by group index): the local store, and for what misses there the
        remote tier, reading through into the local store, all within one ``remote.timeout``."""
        if self.remote is None or not self.active:
            return self._stored_dense
        remote, deadline = self.remote, time.monotonic() + self.remote.rc.timeout
        return lambda index, keys: remote.stored(self.namespaces, self.group_ids[index], keys, deadline)

    def lookup(self, tokens: Sequence[int], cache_salt: Salt, num_computed_tokens: int = 0,
               window_aware: bool = False) -> Lookup:
        """How many of ``tokens`` beyond the ``num_computed_tokens`` the engine holds the store
        serves (``Lookup.num_new_tokens``; full blocks only, never the last token), with every
        served chunk of every group and shard leased: in the same pass as the presence checks
        (``_stored_leased``), or, with a remote tier or ``window_aware``, after them, planned
        again, once, when a lease fails. ``window_aware``: ``plan_lookup_window_aware`` (a
        sliding group needs, and leases, only the blocks inside its window before the served
        length)."""
        stored = self._lookup_stored()
        t0 = time.perf_counter()
        for attempt in (0, 1):
            if window_aware:
                found = plan_lookup_window_aware(tokens, cache_salt, self.tokens_per_block, num_computed_tokens,
                                                 self.windows, stored)
                leased = self.lease_per_group([[found.keys[o] for o in r] for r in lookup_needs(found, self.windows)])
            elif self.remote is None and self.active:  # asked and leased in one pass
                found = plan_lookup(tokens, cache_salt, self.tokens_per_block, num_computed_tokens, len(self.group_ids),
                                    self._stored_leased)
                leased = True
            else:
                found = plan_lookup(tokens, cache_salt, self.tokens_per_block, num_computed_tokens, len(self.group_ids),
                                    stored)
                leased = self.lease(found.keys[found.first_block:found.end_block])
            if leased:
                break
            self._count(lease_replans=1)
            if attempt:  # the second plan's lease failed too: promise nothing rather than a miss
                found = Lookup(found.keys, found.first_block, found.first_block, num_computed_tokens, self.tokens_per_block)
        self._count(lookups=1, lookup_tokens=len(tokens), matched_tokens=found.num_new_tokens)
        if self.active:
            shared = self.namespace.counters  # what `gdskv stats` sums across processes
            shared.add("lookups")
            shared.add("lookup_tokens", len(tokens))
            shared.add("lookup_matched_tokens", found.num_new_tokens)
            self._dirty = True
            if self.metrics is not None:
                self.metrics.observe("lookup", self.namespace, time.perf_counter() - t0)
        return found

    def lookup_keys(self, keys: Sequence[bytes], first_block: int = 0) -> int:
        """For an engine that names blocks itself (MAX's canonical hashes): the ordinal one past
        the run of ``keys[first_block:]`` every group and shard holds, leased; planned again,
        once, when a lease fails."""
        stored = self._lookup_stored()
        for attempt in (0, 1):
            end = len(keys)
            for i in range(len(self.group_ids)):  # each group is asked only about the run the others hold
                end = contiguous_hits([stored(i, keys[first_block:end])], first_block)
                if end <= first_block:
                    return first_block
            if self.lease(keys[first_block:end]):
                return end
            self._count(lease_replans=1)
        return first_block

    def lease_per_group(self, keys_by_group: Sequence[Sequence[bytes]]) -> bool:
        """Like ``lease``, with keys per group (index into ``group_ids``); False when one was gone."""
        ok = True
        for ns in self.namespaces:
            for g, keys in zip(self.group_ids, keys_by_group):
                if keys:
                    ok = all(ns.lease_many(g, list(keys), lease_seconds=self.lease_seconds)) and ok
        return ok

    def lease(self, keys: Sequence[bytes]) -> bool:
        """Lease ``keys``' chunks (every group, every shard) to the load that follows; False when
        one was gone by then."""
        if not keys:
            return True
        ok = True
        for ns in self.namespaces:
            for g in self.group_ids:
                ok = all(ns.lease_many(g, list(keys), lease_seconds=self.lease_seconds)) and ok
        return ok

    # -- transfers --------------------------------------------------------------------------------
    def register_memory(self, tensors: Sequence[Any]) -> int:
        """Register the engine's page memory with the I/O engine once, at bring-up (cuFile buffer
        registration under GDS; a no-op elsewhere); how many allocations were registered."""
        return self.engine.register_buffers(tensors) if self.transfers and self.engine is not None else 0

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

    def reap(self) -> None:
        """Finish, on this thread, the saves and asynchronous loads whose pages moved since the
        last call (``PageTransfer.reap``: their bookkeeping, their futures and those futures'
        callbacks). The serving loop calls it between steps (the TensorRT-LLM and vLLM workers,
        before they look at their transfers' futures; MAX's offloads when polled), so no transfer
        thread takes the interpreter from it; uncalled, they finish anyway,
        ``gdskv.transfer.REAP_GRACE`` seconds later, or at once for a caller blocked on a result."""
        for transfer in self.transfers.values():
            transfer.reap()

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

    def _borrow_many(self, rank: int, group: int, keys: list[bytes], sizes: list[Optional[int]]) -> list[Optional[Borrowed]]:
        """The host tier's entries for a step's pages of ``sizes`` bytes each (``payload_nbytes``
        of their segments; only entries of exactly that size), lent until released; a None is a
        miss, counted (the caller reads the disk)."""
        lents = self.host.borrow_many([(rank, group, key) for key in keys], sizes)
        misses = lents.count(None)
        if misses:
            self._count(host_misses=misses)
            self.namespaces[rank].counters.add("host_misses", misses)
        return lents

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

    def _reserve_many(self, rank: int, group: int, keys: list[bytes], sizes: list[Optional[int]],
                      saving: bool = False) -> list[Optional[Reserved]]:
        """Host-tier buffers for a step's pages about to be read from the disk or saved (the
        transfer copies each payload there in the pass that copies it into the page, or seals it:
        ``PageTransfer.load_pages`` / ``save_pages``); a None where the tier holds the page
        already, it does not fit (for saves: ``HostTier.reserve_many``'s ``saving``), or its segments
        cannot be copied in place (size None)."""
        try:
            return self.host.reserve_many([(rank, group, key) for key in keys], sizes, saving)
        except Exception as e:  # never into the serving loop: the pages are only not kept
            log.warning("gdskv: no host-tier buffers for %d pages: %s", len(keys), e)
            return [None] * len(keys)

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

    def _keep(self, rank: int, group: int, pages: list[tuple[bytes, list[Any], Optional[Reserved], bool]],
              skipped: list[Optional[Reserved]]) -> list[tuple[Put, int]]:
        """The host tier's side of a finished slice, ``(key, segments, slot, ok)`` per page (ok:
        LOADED, or PUBLISHED): an ok page's reserved buffer, which the transfer filled with the
        payload it read or wrote, becomes its entry, and an ok page without one is copied in;
        every other buffer, the skipped pages' too, is given back. The puts and their bytes,
        for ``_count_puts``."""
        puts: list[tuple[Put, int]] = []
        commits: list[Reserved] = []
        aborts = [slot for slot in skipped if slot is not None]
        for key, segments, slot, ok in pages:
            if slot is not None:
                (commits if ok else aborts).append(slot)
            elif ok and self.host is not None:
                puts.append(self._fill(key=(rank, group, key), segments=segments))
        if commits or aborts:
            sizes = [slot.buf.numel() for slot in commits] + [0] * len(aborts)
            puts += zip(self.host.settle_many(commits, aborts), sizes)
        return puts

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

    def _fill(self, key: tuple[int, int, bytes], segments: list[Any]) -> tuple[Put, int]:
        """Copy a page into the host tier (a save just published it; a load just verified it),
        on the transfer's thread before the caller sees the page done, so it is still unchanged;
        the put and the page's bytes, for ``_count_puts``. Never raises: a page not taken is only
        a later miss."""
        size = payload_nbytes(segments) or 0
        try:
            return self.host.put(key, segments), size
        except Exception as e:
            log.warning("gdskv: a page was not copied into the host tier: %s", e)
            return Put(), size

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

    # -- counters ---------------------------------------------------------------------------------
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

    def close(self) -> None:
        """Wait for in-flight transfers, write the counters, close the I/O engine (when the
        service made it). Idempotent."""
        if self.transfers:
            transfers, self.transfers, self.transfer = list(self.transfers.values()), {}, None
            for transfer in transfers:
                transfer.close()
            if self._owns_engine and self.engine is not None:
                self.engine.close()
        if self.remote is not None:
            remote, self.remote = self.remote, None
            remote.close()
            self._dirty = True
        if self._host_copies is not None:
            self._host_copies.shutdown(wait=True)
            self.host.clear()
        self.flush_stats(force=True)

    # -- engines that name blocks themselves (MAX) ------------------------------------------------
    def held(self, group: int, keys: Sequence[bytes], shard: int, lease: bool = False) -> list[bool]:
        """For each key, whether TP shard ``shard``'s chunk of it (layer group ``group``) is in the
        store; with ``lease``, also leased to a load that follows (``lease_seconds``, respected by
        eviction in any process; False when the chunk was gone by then). For an engine that
        combines shards itself (``gdskv.planner.held_everywhere``): a replicated leaf is stored
        on shard 0 alone. With ``lease`` (a lookup) and a remote tier, keys missing locally are
        read through from the remote first."""
        if not self.active or not keys:
            return [False] * len(keys)
        ns = self.namespaces[shard]
        if lease:
            if self.remote is not None:  # a lookup: what misses locally is read through first
                self.remote.stored([ns], group, keys, time.monotonic() + self.remote.rc.timeout)
            return ns.lease_many(group, list(keys), lease_seconds=self.lease_seconds)
        return ns.contains_many(group, keys)

    def touch(self, group: int, keys: Sequence[bytes], shard: int) -> int:
        """Refresh the recency of ``keys``' chunks of shard ``shard`` (root first: give the run in
        prefix order); missing keys are skipped. How many chunks were touched."""
        return self.namespaces[shard].touch_many(group, keys) if self.active else 0


class Lineage:
    """Recent ``block key -> parent key`` links, for an engine that names its blocks itself and
    hands the service runs of them (MAX: root-anchored runs in ``lookup`` / ``touch``, offload
    runs whose first block comes with no parent). Learnt from each run; bounded (the least
    recently learnt link is forgotten first); thread-safe. ``KvService.lineage`` is one."""

    def __init__(self, capacity: int = LINEAGE_CAPACITY) -> None:
        self._parent: OrderedDict[bytes, bytes] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def learn(self, run: Sequence[bytes]) -> None:
        """Each key of ``run`` (in prefix order) is the parent of the next."""
        with self._lock:
            for parent, child in zip(run, run[1:]):
                self._parent[child] = parent
                self._parent.move_to_end(child)
            while len(self._parent) > self._capacity:
                self._parent.popitem(last=False)

    def parent_of(self, key: bytes) -> Optional[bytes]:
        """The parent last learnt for ``key``, or None."""
        with self._lock:
            return self._parent.get(key)


def _flush_at_exit(ref: "weakref.ref[KvService]") -> None:
    """At interpreter exit: write the counter file of a service still alive (never raises)."""
    service = ref()
    if service is not None:
        with contextlib.suppress(Exception):
            service.flush_stats(force=True)


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
