"""gdskv as a Modular MAX KVConnector: MAX's paged KV pool ⇄ gdskv's store.

MAX's cache manager owns the device pages, their allocation and the on-device prefix cache; it
asks a connector which blocks an external tier holds (``lookup``), has it read blocks into pages
(``load``) and write committed pages out (``offload``). ``GdsKvConnector`` answers from gdskv's
store (``docs/max.md`` says how to run it, ``../shared/spec/max-kvconnector.md`` is the contract):

- **Leaves are layer groups.** Each leaf MAX names is a layer group of one store namespace (sorted
  leaf ids numbered 0, 1, ...; the ids and their attention shapes are part of the namespace), so
  the leaf is part of every chunk's key.
- **Keys as given.** MAX's canonical block hashes (8 big-endian bytes for ahash64, 32 for
  SHA-256) are the block keys, validated at this boundary with ``gdskv.keys.canonical_key``.
- **TP shards are namespaces.** Shard ``r`` of ``n`` writes to the namespace with
  ``tp_rank=r, tp_size=n``; a block is present only when every shard's chunk is (a replicated
  leaf, e.g. MLA, is stored once, from shard 0, and read into every shard).
- **Loads are all-or-raise.** ``load`` checks (and pins, under a byte budget) every chunk before
  it posts anything: a missing one raises ``KVLoadRefused`` naming the leaf and the hash. Each
  chunk is read into a scratch buffer and verified (key and checksum) before it is copied into
  its page, so a page never holds unverified bytes; a chunk that fails makes the transfer raise
  ``KVLoadFailed`` from every poll, once nothing is in flight any more.
- **Offloads publish when written.** Chunks are renamed into place only after their bytes are
  written, so a block is visible to ``lookup`` exactly when all its shards landed.
- **Device order.** ``load`` and ``offload`` record a readiness on the engine's stream of each
  page's device when MAX hands the blocks over (``gdskv.streams``); no byte of a page is written
  (load) or read (offload) before it, so kernels queued earlier finish with the slot first. A
  load's copy into its pages has landed before the transfer completes, and MAX reads the pages
  only after it saw that. Device memory is viewed zero-copy or the connector refuses to start.
- **Nothing blocks the scheduler.** Loads, offloads, ``start_lookup`` and ``touch`` run on
  background threads; polls read a flag.

``install()`` wires the connector into MAX's Jenga cache manager (MAX has no plugin hook);
``python -m gdskv.connectors.max_launch`` is the ``max`` CLI with it installed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gdskv import streams
from gdskv.config import ConfigError, GdsKvConfig, load_config
from gdskv.eviction import disk_usage, install_budget, scan_store
from gdskv.garbage import collect_in_background
from gdskv.io import IoEngine, make_engine
from gdskv.keys import canonical_key
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus
from gdskv.connectors.max_types import (
    ByteCount,
    CompletedTransfer,
    KVCacheGroupId,
    KVCacheMetrics,
    KVConnectorTransfer,
    KVLoadFailed,
    KVLoadRefused,
    KVTransfer,
)

log = logging.getLogger(__name__)

CONNECTOR_NAME = "gdskv"
ENV_MODEL = "GDSKV_MAX_MODEL"
"""Model identity for the namespace when the config has no ``model_id`` (the launcher sets it
from ``--model-path``)."""
ENV_METRICS = "GDSKV_MAX_METRICS"
"""When set, the connector's lifetime counters are kept in this JSON file (rewritten whenever a
transfer settles, and at shutdown)."""
ENV_HOOK = "GDSKV_MAX_HOOK"
"""Set to ``1`` by a process that installed the hook for MAX model workers it spawns; see
``install_if_requested``."""
LINEAGE_CAPACITY = 1 << 16
"""How many ``block -> parent`` links the connector remembers from the hash runs MAX shows it."""
LOOKUP_LEASE_SECONDS = 30.0
"""How long the chunks a ``start_lookup`` found stay pinned when neither ``load_lookup`` nor
``abandon_lookup`` follows."""


class _Lineage:
    """Recent ``block hash -> parent hash`` links, learnt from the root-anchored runs MAX passes to
    ``lookup`` / ``start_lookup`` / ``touch`` and from each ``offload`` run. ``offload`` gives a
    run's first block no parent; this is where it comes from, so prefix-aware eviction sees
    whole chains. Bounded (least recently learnt forgotten first); thread-safe."""

    def __init__(self, capacity: int = LINEAGE_CAPACITY) -> None:
        self._parent: OrderedDict[bytes, bytes] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def learn(self, run: Sequence[bytes]) -> None:
        with self._lock:
            for parent, child in zip(run, run[1:]):
                self._parent[child] = parent
                self._parent.move_to_end(child)
            while len(self._parent) > self._capacity:
                self._parent.popitem(last=False)

    def parent_of(self, key: bytes) -> Optional[bytes]:
        with self._lock:
            return self._parent.get(key)


# --- plain data ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeafMemory:
    """One leaf's page memory on one DP replica.

    ``shards[r]`` is TP shard ``r``'s pages: a 2-D ``uint8`` tensor ``[num_pages, bytes_per_page]``
    whose row ``i`` (contiguous) is device block ``i``; rows may be padded apart. ``replicated``
    means every shard holds the same bytes. Built by ``create_gdskv_connector`` from MAX's
    ``KVCacheMemory`` (zero-copy), or by tests from plain tensors.
    """

    shards: tuple[torch.Tensor, ...]
    replicated: bool = False

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("a leaf needs at least one shard")
        shape = self.shards[0].shape
        for r, t in enumerate(self.shards):
            if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
                raise ValueError(f"shard {r}: pages must be a 2-D uint8 tensor with contiguous rows, "
                                 f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
            if t.shape != shape:
                raise ValueError(f"shard {r} has shape {tuple(t.shape)}, shard 0 has {tuple(shape)}")

    @property
    def bytes_per_page(self) -> int:
        return int(self.shards[0].shape[1])

    @property
    def num_pages(self) -> int:
        return int(self.shards[0].shape[0])

    def page(self, shard: int, block_id: int) -> torch.Tensor:
        """Device block ``block_id`` of ``shard``; ``ValueError`` outside the pool."""
        if not 0 <= block_id < self.num_pages:
            raise ValueError(f"block id {block_id} outside the pool [0, {self.num_pages})")
        return self.shards[shard][block_id]


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
class _Counts:
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


@dataclass
class _Occupancy:
    """The store's chunk bytes as the last background scan measured them (when no byte budget
    keeps a running count), and when (monotonic seconds)."""

    used: int = 0
    measured_at: float = float("-inf")
    refreshing: bool = False


# --- the connector ------------------------------------------------------------------------------
class GdsKvConnector:
    """The KVConnector protocol over a gdskv store.

    Built once per MAX cache manager by ``create_gdskv_connector`` (through ``install()``), or
    directly by tests. Every method is called by MAX's scheduler thread; the work runs on this
    object's threads. Thread-safe.
    """

    def __init__(
        self,
        leaves: Mapping[str, KVCacheGroupId],
        replica_memory: Sequence[Mapping[str, LeafMemory]],
        *,
        model: str,
        dtype: str,
        tokens_per_block: int,
        config: Optional[GdsKvConfig] = None,
        extra: Optional[Mapping[str, str]] = None,
        engine: Optional[IoEngine] = None,
        stats_file: Optional[str] = None,
        engine_streams: Optional[Mapping[torch.device, Any]] = None,
    ) -> None:
        """``leaves`` and ``replica_memory`` as MAX's ``create_connector`` hands them (memory as
        ``LeafMemory``); ``model`` / ``dtype`` / ``tokens_per_block`` / ``extra`` identify the KV
        (they make the namespace). ``config`` defaults to ``load_config()``; ``engine`` to
        ``make_engine(config)`` (then owned and closed here). ``engine_streams``: the stream MAX
        runs on per CUDA device (default: the device's current stream). Raises ``ValueError`` naming the
        leaf for memory that does not describe the leaves."""
        if not leaves:
            raise ValueError("gdskv MAX connector: no leaves to serve")
        if not replica_memory:
            raise ValueError("gdskv MAX connector: no replica memory")
        self._leaves: dict[str, KVCacheGroupId] = dict(leaves)
        self._memory = [dict(m) for m in replica_memory]
        self._gid = {leaf: i for i, leaf in enumerate(sorted(self._leaves))}
        first = self._memory[0]
        tp_size = 0
        for r, mem in enumerate(self._memory):
            for leaf in self._leaves:
                if leaf not in mem:
                    raise ValueError(f"gdskv MAX connector: replica {r} has no memory for leaf {leaf!r}")
                m, m0 = mem[leaf], first[leaf]
                if (len(m.shards), m.bytes_per_page, m.replicated) != (len(m0.shards), m0.bytes_per_page, m0.replicated):
                    raise ValueError(f"gdskv MAX connector: leaf {leaf!r} has another page geometry on replica {r}")
                tp_size = tp_size or len(m.shards)
                if len(m.shards) != tp_size:
                    raise ValueError(f"gdskv MAX connector: leaf {leaf!r} has {len(m.shards)} TP shards, other leaves {tp_size}")
        self._cfg = config if config is not None else load_config()
        groups = tuple(GroupSpec(gid, first[leaf].bytes_per_page, (), _window_of(self._leaves[leaf]))
                       for leaf, gid in self._gid.items())
        ident = {"engine": "max", "leaves": ";".join(f"{gid}={leaf}={_shape_of(self._leaves[leaf])}" for leaf, gid in self._gid.items())}
        ident |= dict(extra or {})
        spec = NamespaceSpec(model, dtype, int(tokens_per_block), groups, 0, tp_size,
                             extra=tuple(sorted((str(k), str(v)) for k, v in ident.items())))
        self._store = PageStore.from_config(self._cfg)
        install_budget(self._store, self._cfg)
        collect_in_background(self._store)
        self._namespaces: list[Namespace] = [self._store.namespace(spec.with_rank(r)) for r in range(tp_size)]
        self._owns_engine = engine is None
        self._engine = engine if engine is not None else make_engine(self._cfg)
        self._engine.register_buffers([t for mem in self._memory for lm in mem.values() for t in lm.shards])
        auth_key = self._cfg.auth_key()
        self._xfers = [PageTransfer(ns, self._engine, threads=self._cfg.io_threads, stats_flush_seconds=self._cfg.stats_flush_seconds,
                                    auth_key=auth_key) for ns in self._namespaces]
        self._jobs = ThreadPoolExecutor(self._cfg.io_threads, thread_name_prefix="gdskv-max-load")
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="gdskv-max-lookup")
        self._background = ThreadPoolExecutor(1, thread_name_prefix="gdskv-max-bg")
        self._lock = threading.Lock()
        self._lineage = _Lineage()
        self._window = _Counts()
        self._total = _Counts()
        self._inflight = 0
        self._occupancy = _Occupancy()
        self._live_lookups: set[GdsKvLookup] = set()
        self._closed = False
        self._stats_file = stats_file
        self._engine_streams = dict(engine_streams or {})
        self._stats_mu = threading.Lock()
        log.info("gdskv MAX connector: store %s, namespace(s) %s, leaves %s, %d TP shard(s), I/O %s",
                 self._store.root, ",".join(ns.id for ns in self._namespaces), ident["leaves"], tp_size,
                 self._engine.describe())

    # --- identity ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Connector name, for MAX's logs."""
        return CONNECTOR_NAME

    @property
    def leaves(self) -> Mapping[str, KVCacheGroupId]:
        """The leaves this connector serves, as MAX named them (read by MAX's cache manager,
        which keys ``lookup``'s masks and ``load``/``offload``'s arguments by them)."""
        return dict(self._leaves)

    @property
    def namespaces(self) -> list[Namespace]:
        """The store namespaces, one per TP shard (shard ``r`` is ``namespaces[r]``). For tests
        and tools; MAX does not call it."""
        return list(self._namespaces)

    def layer_group(self, leaf_id: str) -> int:
        """The store layer group that holds ``leaf_id``'s pages. For tests and tools."""
        return self._gid[leaf_id]

    # --- presence ----------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: Optional[bytes] = None) -> dict[str, list[bool]]:
        """Which of ``block_hashes`` each leaf holds on every TP shard: one positional mask per
        leaf, ``len(block_hashes)`` long. Holds nothing (not a reservation). ``hint`` is unused
        (it routes dKV peers). Raises ``ValueError``/``TypeError`` for a malformed hash.
        Called by MAX's cache manager when it admits a request (``alloc``), before ``load``."""
        keys = _keys(block_hashes)
        self._replica(replica_idx)
        self._lineage.learn(keys)
        self._count(lookups=1)
        return self._presence(keys)

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int], hint: Optional[bytes] = None) -> list[dict[str, list[bool]]]:
        """What each replica could load, for pricing: the store is replica-agnostic, so every
        entry is the same ``lookup`` answer (one shared mapping; callers only read it). Answered
        from the store's index (a ``stat`` per chunk) without pinning anything. Called by MAX's
        scheduler once per arriving request, to weigh DP replicas against each other."""
        keys = _keys(block_hashes)
        for r in replica_idxs:
            self._replica(r)
        masks = self._presence(keys)
        return [masks for _ in replica_idxs]

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        """True: ``start_lookup`` answers on a background thread (the store may be a shared
        file system where a ``stat`` is a round trip). Asked by MAX's scheduler, which counts
        such lookups against its bound on unanswered ones."""
        return True

    def start_lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: Optional[bytes] = None) -> "GdsKvLookup":
        """Start a ``lookup`` on a background thread and return its handle at once.

        Under a byte budget the chunks it finds stay pinned (not evicted) until ``load_lookup``
        or ``abandon_lookup`` takes the handle, or ``LOOKUP_LEASE_SECONDS`` pass. Malformed
        hashes raise here, synchronously. Called by MAX's scheduler in place of ``lookup``
        (``defers_lookup`` is True); it holds the request out of the batch until the handle
        completes."""
        keys = _keys(block_hashes)
        self._replica(replica_idx)
        self._lineage.learn(keys)
        handle = GdsKvLookup(keys, replica_idx, time.monotonic() + LOOKUP_LEASE_SECONDS)
        with self._lock:
            self._live_lookups.add(handle)
        self._count(lookups=1)
        handle._future = self._lookups.submit(self._lookup_job, handle)
        return handle

    def abandon_lookup(self, lookup: Any) -> None:
        """Release what a ``start_lookup`` handle holds (its pins). Never raises; safe on a
        handle that has not answered, was loaded from, found nothing, or is not ours. Called by
        MAX's scheduler for a lookup it will not load from; by ``load_lookup``,
        ``poll_transfers`` (expired leases) and ``shutdown`` here."""
        try:
            if isinstance(lookup, GdsKvLookup):
                lookup._release(self._unpin)
                with self._lock:
                    self._live_lookups.discard(lookup)
        except Exception:  # never into the scheduler
            log.exception("gdskv: abandon_lookup failed")

    def load_lookup(self, lookup: Any, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                    replica_idx: int = 0, hint: Optional[bytes] = None) -> KVTransfer:
        """``load`` out of a completed ``start_lookup``: the load pins its own chunks before the
        lookup's pins are released, so nothing it found can be evicted in between. Consumes the
        handle however it exits. Called by MAX's cache manager in place of ``load`` when the
        request's lookup was a ``start_lookup``."""
        try:
            if isinstance(lookup, GdsKvLookup) and lookup.replica_idx != replica_idx:
                raise ValueError(f"load_lookup for replica {replica_idx} with a lookup started for replica {lookup.replica_idx}")
            return self.load(block_ids, block_hashes, replica_idx, hint)
        finally:
            self.abandon_lookup(lookup)

    # --- moving pages ------------------------------------------------------------------------
    def load(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
             replica_idx: int = 0, hint: Optional[bytes] = None) -> KVTransfer:
        """Read ``block_hashes[leaf][i]`` into device block ``block_ids[leaf][i]``, every leaf,
        every TP shard, or nothing. Called by MAX's cache manager after a ``lookup`` (at most
        once per lookup) for the blocks it decided to onload.

        Each stored chunk is read once: a replicated leaf's chunk is copied into every shard.
        Returns a ``CompletedTransfer`` when asked for nothing, else a transfer MAX polls.
        Raises ``KVLoadRefused`` (naming leaf and hash) when a chunk is not stored, before
        anything moves; ``KVLoadFailed`` when the copy cannot be posted (connector shut down);
        ``ValueError``/``TypeError`` for malformed arguments (unknown leaf, lengths that differ,
        bad hash, block id outside the pool)."""
        mem = self._replica(replica_idx)
        plan = self._plan(block_ids, block_hashes)
        chunks = [(leaf, key, src, [mem[leaf].page(shard, bid) for shard in dests])
                  for leaf, pairs in plan.items() for bid, key in pairs
                  for src, dests in self._load_routes(leaf)]
        if not chunks:
            return CompletedTransfer()
        paths = [self._namespaces[src].chunk_path(self._gid[leaf], key) for leaf, key, src, _ in chunks]
        self._pin(paths)
        try:
            for leaf, key, src, _ in chunks:
                if not self._namespaces[src].contains(self._gid[leaf], key):
                    raise KVLoadRefused(
                        f"gdskv: leaf {leaf!r} block {key.hex()} is not stored (shard namespace "
                        f"{self._namespaces[src].id}); evicted since the lookup?", leaf_id=leaf, block_hash=key)
        except KVLoadRefused:
            self._unpin(paths)
            self._count(loads_refused=1)
            raise
        blocks = sum(len(pairs) for pairs in plan.values())
        ready = self._ready(p for *_, pages in chunks for p in pages)  # the slots may still be in use
        transfer = _LoadTransfer(self, [(leaf, key, pages[0].numel()) for leaf, key, _, pages in chunks], blocks, paths)
        abort = transfer.abort
        futures: list[Future] = []
        try:
            for leaf, key, src, pages in chunks:
                futures.append(self._jobs.submit(self._load_page, self._xfers[src], self._gid[leaf], key, pages, abort, ready))
        except Exception as e:  # executor shut down: nothing may stay in flight into the pages
            abort.set()
            for f in futures:
                f.cancel()
            for f in futures:
                _wait_quietly(f)
            self._unpin(paths)
            self._count(load_failures=1)
            raise KVLoadFailed(f"gdskv: could not post the load: {e}") from e
        self._count(inflight=len(futures))
        transfer.start(futures)
        return transfer

    def offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                replica_idx: int = 0) -> KVConnectorTransfer:
        """Write device block ``block_ids[leaf][i]`` under ``block_hashes[leaf][i]``.

        Blocks every shard already stores are skipped; the rest are written in the background and
        published (renamed into place) once their bytes are on disk. The transfer's
        ``g0_blocks_per_leaf`` are the blocks it reads, which MAX keeps pinned until it completes;
        a ``CompletedTransfer`` when nothing needed writing. Never fails the caller for I/O: a
        full disk or budget drops the block (``connector_offload_blocks_dropped``). Called by
        MAX's cache manager every step, after ``load``, with the blocks committed since."""
        mem = self._replica(replica_idx)
        plan = self._plan(block_ids, block_hashes)
        taken: dict[str, list[int]] = {}
        work: list[tuple[str, int, int, bytes, Optional[bytes], torch.Tensor]] = []  # leaf, bid, shard, key, parent, page
        skipped = 0
        for leaf, pairs in plan.items():
            if not pairs:
                continue
            stored = self._present_all_shards(leaf, [k for _, k in pairs])
            chained = not self._leaves[leaf].is_recurrent()
            if chained:
                self._lineage.learn([k for _, k in pairs])
            for i, ((bid, key), have) in enumerate(zip(pairs, stored)):
                if have:
                    skipped += 1
                    continue
                parent = (pairs[i - 1][1] if i > 0 else self._lineage.parent_of(key)) if chained else None
                work.extend((leaf, bid, shard, key, parent, mem[leaf].page(shard, bid)) for shard in self._store_shards(leaf))
                taken.setdefault(leaf, []).append(bid)
        self._count(offload_blocks_skipped=skipped)
        if not work:
            return CompletedTransfer()
        posted: list[tuple[tuple[str, int], int, Future]] = []
        unposted: set[tuple[str, int]] = set()
        ready = self._ready(w[-1] for w in work)  # the step that wrote a block may still be running
        for leaf, bid, shard, key, parent, page in work:
            try:
                fut = self._xfers[shard].save_page(self._gid[leaf], key, parent, [page], ready=ready)
            except Exception as e:  # connector shut down: the block is dropped, counted
                log.warning("gdskv: could not post an offload of leaf %r block %s: %s", leaf, key.hex(), e)
                unposted.add((leaf, bid))
                continue
            posted.append(((leaf, bid), page.numel(), fut))
        if not posted:
            self._count(offload_blocks_dropped=len(unposted))
            return CompletedTransfer()
        self._count(inflight=len(posted))
        transfer = _OffloadTransfer(self, taken)
        transfer.start(posted, unposted)
        return transfer

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Refresh the recency of ``block_hashes`` (root first, in the order given) in every
        leaf and shard, on a background thread. Returns at once and never raises; missing and
        malformed hashes are ignored. Called by MAX's cache manager for the run a request
        reuses (served from device or loaded) and when it releases a request."""
        try:
            hashes = list(block_hashes)
            self._background.submit(self._touch_job, hashes)
        except Exception as e:  # shut down, or not a sequence: a missed touch costs a refetch at most
            log.debug("gdskv: touch dropped: %s", e)

    def poll_transfers(self) -> None:
        """Release the pins of ``start_lookup`` handles nobody took within their lease. Called by
        MAX on every drain of its in-flight transfers; cheap; never raises."""
        try:
            now = time.monotonic()
            with self._lock:
                expired = [h for h in self._live_lookups if h.deadline < now]
            for h in expired:
                self.abandon_lookup(h)
        except Exception:
            log.exception("gdskv: poll_transfers failed")

    # --- occupancy and metrics ---------------------------------------------------------------
    @property
    def host_byte_count(self) -> ByteCount:
        """gdskv has no host tier: pages go between device memory and disk. Read by MAX's
        cache manager for its occupancy reports, like ``disk_byte_count``."""
        return ByteCount(free=0, total=0)

    @property
    def disk_byte_count(self) -> ByteCount:
        """The store's chunk bytes against its capacity: the byte budget when one is set (free
        also bounded by the file system), else what is used plus what the file system has free.
        The chunk bytes are the budget's running count, or, without a budget, a background
        scan's at most every ``stats_flush_seconds`` (the latest is returned at once). Read by
        MAX's cache manager for its occupancy reports."""
        budget = self._store.budget
        used = budget.used_bytes if budget is not None else None
        if used is None:
            used = self._scanned_bytes()
        try:
            fs_free = disk_usage(str(self._store.root))[1]
        except OSError:
            fs_free = 0
        if self._cfg.max_bytes is not None:
            total = self._cfg.max_bytes
            return ByteCount(free=max(0, min(total - used, fs_free)), total=total)
        return ByteCount(free=fs_free, total=used + fs_free)

    @property
    def metrics(self) -> GdsKvMetrics:
        """Counters since the last ``take_metrics``; MAX's cache manager adds them to its own
        ``metrics``."""
        with self._lock:
            return self._as_metrics(self._window)

    def take_metrics(self) -> GdsKvMetrics:
        """Read and clear the per-batch counters (``inflight_disk_ops`` is a level, not cleared).
        Called by MAX's cache manager once per batch, from its own ``take_metrics``."""
        with self._lock:
            out = self._as_metrics(self._window)
            self._window = _Counts()
            return out

    def stats(self) -> dict[str, int]:
        """Lifetime counters of this connector (blocks and bytes read and written, refusals,
        failures, dropped and skipped offloads, lookups, touches). Written to ``stats_file``;
        for tests, tools and ``write_stats``."""
        with self._lock:
            return dataclasses.asdict(self._total) | {"inflight_disk_ops": self._inflight}

    def write_stats(self, path: Optional[str] = None) -> None:
        """Write ``stats()`` as JSON to ``path`` (default: ``stats_file``), atomically. Called
        whenever a transfer settles and at ``shutdown``; a no-op without a path."""
        path = path or self._stats_file
        if not path:
            return
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with self._stats_mu:  # one writer at a time: the newest counters land last
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(tmp).write_text(json.dumps(self.stats() | {"pid": os.getpid()}, indent=1))
                os.replace(tmp, path)
        except OSError as e:
            log.warning("gdskv: could not write connector stats to %s: %s", path, e)

    def reset_prefix_cache(self) -> None:
        """Kept as is: the store is persistent and shared with other processes, so MAX resetting
        its own prefix cache (which calls this) does not erase it (``gdskv evict`` does that on
        purpose)."""

    def shutdown(self) -> None:
        """Wait for in-flight work, release pins, close threads (and the I/O engine when this
        connector made it), persist counters. Idempotent; called by MAX's cache manager."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lookups = list(self._live_lookups)
        for h in lookups:
            self.abandon_lookup(h)
        for pool in (self._jobs, self._lookups, self._background):
            pool.shutdown(wait=True)
        for h in lookups:  # a lookup that answered after its first release
            self.abandon_lookup(h)
        for x in self._xfers:
            x.close()
        if self._owns_engine:
            self._engine.close()
        self.write_stats()

    # --- internals ---------------------------------------------------------------------------
    def _replica(self, replica_idx: int) -> dict[str, LeafMemory]:
        if not isinstance(replica_idx, int) or not 0 <= replica_idx < len(self._memory):
            raise ValueError(f"replica_idx {replica_idx!r} outside [0, {len(self._memory)})")
        return self._memory[replica_idx]

    def _ready(self, pages: Iterable[torch.Tensor]) -> Optional[streams.Readiness]:
        """The readiness of the engine's work queued so far on the devices of ``pages``."""
        return streams.record_ready(devices={p.device for p in pages}, streams=self._engine_streams)

    def _store_shards(self, leaf: str) -> range:
        """The shards whose namespaces hold ``leaf``'s chunks (shard 0 alone when replicated)."""
        m = self._memory[0][leaf]
        return range(1) if m.replicated else range(len(m.shards))

    def _load_routes(self, leaf: str) -> list[tuple[int, range]]:
        """``(source namespace, destination shards)`` of a load of ``leaf``: each shard from its
        own namespace, or a replicated leaf's one chunk (shard 0's) into every shard."""
        m = self._memory[0][leaf]
        n = len(m.shards)
        return [(0, range(n))] if m.replicated else [(r, range(r, r + 1)) for r in range(n)]

    def _present_all_shards(self, leaf: str, keys: Sequence[bytes]) -> list[bool]:
        gid = self._gid[leaf]
        mask = [True] * len(keys)
        for shard in self._store_shards(leaf):
            got = self._namespaces[shard].contains_many(gid, keys)
            mask = [a and b for a, b in zip(mask, got)]
        return mask

    def _presence(self, keys: Sequence[bytes]) -> dict[str, list[bool]]:
        return {leaf: self._present_all_shards(leaf, keys) for leaf in self._leaves}

    def _plan(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]]) -> dict[str, list[tuple[int, bytes]]]:
        """``{leaf: [(block id, key), ...]}`` after checking the arguments of load/offload."""
        unknown = (set(block_ids) | set(block_hashes)) - set(self._leaves)
        if unknown:
            raise ValueError(f"unknown leaf id(s) {sorted(unknown)}; this connector serves {sorted(self._leaves)}")
        plan: dict[str, list[tuple[int, bytes]]] = {}
        for leaf in self._leaves:
            ids = list(block_ids.get(leaf, ()))
            hashes = list(block_hashes.get(leaf, ()))
            if len(ids) != len(hashes):
                raise ValueError(f"leaf {leaf!r}: {len(ids)} block ids but {len(hashes)} block hashes")
            plan[leaf] = list(zip((int(b) for b in ids), _keys(hashes, leaf)))
        return plan

    def _pin(self, paths: Iterable[str]) -> None:
        budget = self._store.budget
        if budget is not None:
            for p in paths:
                budget.pin(p)

    def _unpin(self, paths: Iterable[str]) -> None:
        budget = self._store.budget
        if budget is not None:
            for p in paths:
                budget.unpin(p)

    @staticmethod
    def _load_page(xfer: PageTransfer, gid: int, key: bytes, pages: list[torch.Tensor], abort: threading.Event,
                   ready: Optional[streams.Readiness] = None) -> Optional[LoadStatus]:
        """One chunk into its pages (one per destination shard): read into scratch memory once
        ``ready`` (the engine's kernels using the pages are done), verified, then copied; the copy
        has landed before this returns. Runs on a load thread, which bounds the scratch memory in
        use to one page per thread; ``None`` when the transfer failed before this chunk started."""
        if abort.is_set():
            return None
        scratch = torch.empty_like(pages[0])
        status = xfer.load_page(gid, key, [scratch], ready=ready).result()
        if status is LoadStatus.LOADED and not abort.is_set():
            streams.copy_into(pages, scratch)
        return status

    def _lookup_job(self, handle: "GdsKvLookup") -> dict[str, list[bool]]:
        """The body of a ``start_lookup``, on a lookup thread: under a budget, pin what is there
        (pinned before the ``stat``, so nothing found can be evicted), then answer."""
        if self._store.budget is None:  # nothing can be evicted under it: nothing to pin
            return self._presence(handle.keys)
        chunks = [(leaf, i, self._namespaces[s].chunk_path(self._gid[leaf], key))
                  for leaf in self._leaves for s in self._store_shards(leaf) for i, key in enumerate(handle.keys)]
        self._pin(p for _, _, p in chunks)
        masks = self._presence(handle.keys)
        self._unpin(p for leaf, i, p in chunks if not masks[leaf][i])
        handle._hold([p for leaf, i, p in chunks if masks[leaf][i]], self._unpin)
        return masks

    def _touch_job(self, hashes: list[bytes]) -> None:
        try:
            keys = _keys(hashes)
        except (TypeError, ValueError) as e:
            log.debug("gdskv: touch ignored: %s", e)
            return
        self._lineage.learn(keys)
        for leaf in self._leaves:
            for shard in self._store_shards(leaf):
                self._namespaces[shard].touch_many(self._gid[leaf], keys)
        self._count(touches=1)

    def _scanned_bytes(self) -> int:
        """The store's chunk bytes as last scanned; starts a background scan when that one is
        stale. Called by ``disk_byte_count`` where no byte budget keeps a running count."""
        occ = self._occupancy
        with self._lock:
            stale = time.monotonic() - occ.measured_at > self._cfg.stats_flush_seconds
            if not stale or occ.refreshing or self._closed:
                return occ.used
            occ.refreshing = True

        def scan() -> None:
            try:
                occ.used = scan_store(self._store, with_parents=False).total_bytes
                occ.measured_at = time.monotonic()
            finally:
                occ.refreshing = False

        try:
            self._background.submit(scan)
        except RuntimeError:
            occ.refreshing = False
        return occ.used

    def _count(self, inflight: int = 0, **deltas: int) -> None:
        """Add event counts to the ``take_metrics`` window and to the lifetime totals, and
        ``inflight`` to the disk operations in flight, in one step."""
        with self._lock:
            self._inflight += inflight
            self._window.add(**deltas)
            self._total.add(**deltas)

    def _settled(self, jobs: int, **counts: int) -> None:
        """Called by a transfer (on an I/O thread) when its last job finished; keeps
        ``stats_file`` current, since a serving worker may never exit cleanly."""
        self._count(inflight=-jobs, **counts)
        self.write_stats()

    def _as_metrics(self, c: _Counts) -> GdsKvMetrics:
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


# --- handles ------------------------------------------------------------------------------------
@dataclass(eq=False)
class GdsKvLookup:
    """The handle ``GdsKvConnector.start_lookup`` returns; MAX polls ``is_complete`` and reads
    ``result()``, then passes it to ``load_lookup`` or ``abandon_lookup``."""

    keys: list[bytes]
    replica_idx: int
    deadline: float
    _future: Optional["Future[dict[str, list[bool]]]"] = field(default=None, repr=False)
    _pins: list[str] = field(default_factory=list, repr=False)
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
        """How many chunk pins this handle holds now (0 once released)."""
        with self._mu:
            return len(self._pins)

    def _hold(self, paths: list[str], unpin: Callable[[list[str]], None]) -> None:
        """Keep ``paths`` pinned, unless the handle was already released (then unpin now)."""
        with self._mu:
            if not self._released:
                self._pins = paths
                return
        unpin(paths)

    def _release(self, unpin: Callable[[list[str]], None]) -> None:
        with self._mu:
            self._released = True
            pins, self._pins = self._pins, []
        unpin(pins)


class _LoadTransfer:
    """The ``KVTransfer`` of one ``load``: complete when every page landed verified; raises
    ``KVLoadFailed`` from every poll once any page failed and nothing is in flight any more."""

    def __init__(self, owner: GdsKvConnector, items: list[tuple[str, bytes, int]], blocks: int, pins: list[str]) -> None:
        """``items``: ``(leaf, key, bytes)`` of each job (one per chunk read: per block and
        stored shard); ``blocks``: how many leaf blocks they fill; ``pins``: chunk paths to
        unpin at the end."""
        self._owner = owner
        self._items = items
        self._blocks = blocks
        self._pins = pins
        self.abort = threading.Event()
        self._mu = threading.Lock()
        self._futures: list[Future] = []
        self._pending = 0
        self._failure: Optional[str] = None
        self._settled = threading.Event()

    def start(self, futures: list[Future]) -> None:
        self._futures = futures
        self._pending = len(futures)
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: self._job_done(i, f))

    def _job_done(self, i: int, f: Future) -> None:
        leaf, key, _ = self._items[i]
        why = None
        if f.cancelled():
            why = "cancelled"
        elif f.exception() is not None:
            why = f"{type(f.exception()).__name__}: {f.exception()}"
        elif f.result() is None:
            why = "skipped"
        elif f.result() is not LoadStatus.LOADED:
            why = f.result().value
        first_failure = False
        with self._mu:
            if why is not None and self._failure is None:
                self._failure = f"gdskv: load of leaf {leaf!r} block {key.hex()} failed ({why})"
                first_failure = True
            self._pending -= 1
            last = self._pending == 0
        if first_failure:
            self.abort.set()
            for other in self._futures:
                other.cancel()
        if last:
            self._settle()

    def _settle(self) -> None:
        self._owner._unpin(self._pins)
        if self._failure is None:
            self._owner._settled(len(self._futures), loads=1, blocks_read=self._blocks,
                                 bytes_read=sum(n for _, _, n in self._items))
        else:
            log.warning("%s; MAX recomputes the prefix", self._failure)
            self._owner._settled(len(self._futures), loads=1, load_failures=1)
        self._settled.set()

    def is_complete(self) -> bool:
        """Never blocks. ``True`` once every page holds its verified chunk."""
        if not self._settled.is_set():
            return False
        if self._failure is not None:
            raise KVLoadFailed(self._failure)
        return True

    def synchronize(self) -> None:
        """Wait until nothing is in flight (drain and shutdown)."""
        self._settled.wait()


class _OffloadTransfer:
    """The ``KVConnectorTransfer`` of one ``offload``: complete when every chunk was written and
    published, or dropped. Never raises."""

    def __init__(self, owner: GdsKvConnector, taken: dict[str, list[int]]) -> None:
        self._owner = owner
        self._taken = taken
        self._mu = threading.Lock()
        self._pending = 0
        self._jobs = 0
        self._status: dict[tuple[str, int], list[Optional[SaveStatus]]] = {}
        self._bytes = 0
        self._settled = threading.Event()

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        """The device blocks this offload reads (MAX keeps them pinned until it completes)."""
        return self._taken

    def start(self, posted: list[tuple[tuple[str, int], int, Future]], unposted: set[tuple[str, int]]) -> None:
        """Called once by ``offload`` with the posted jobs (``(leaf, block id)``, bytes, future;
        at least one) and the blocks whose jobs could not be posted (counted as dropped)."""
        for block in unposted:
            self._status.setdefault(block, []).append(None)
        self._pending = self._jobs = len(posted)
        for block, nbytes, f in posted:
            f.add_done_callback(lambda f, block=block, nbytes=nbytes: self._job_done(block, nbytes, f))

    def _job_done(self, block: tuple[str, int], nbytes: int, f: Future) -> None:
        status = None if f.cancelled() or f.exception() is not None else f.result()
        with self._mu:
            self._status.setdefault(block, []).append(status)
            if status is SaveStatus.PUBLISHED:
                self._bytes += nbytes
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._settle()

    def _settle(self) -> None:
        written = dropped = 0
        for statuses in self._status.values():
            if any(s is None or s is SaveStatus.DROPPED for s in statuses):
                dropped += 1
            elif any(s is SaveStatus.PUBLISHED for s in statuses):
                written += 1
        self._owner._settled(self._jobs, blocks_written=written, bytes_written=self._bytes,
                             offload_blocks_dropped=dropped)
        self._settled.set()

    def is_complete(self) -> bool:
        """Never blocks; ``True`` once every chunk settled (published, already there, dropped)."""
        return self._settled.is_set()

    def synchronize(self) -> None:
        """Wait until every chunk settled."""
        self._settled.wait()


# --- helpers ------------------------------------------------------------------------------------
def _keys(hashes: Iterable[bytes], leaf: Optional[str] = None) -> list[bytes]:
    """Canonical keys, or an error naming the position (and leaf) of the first bad hash."""
    out = []
    for i, h in enumerate(hashes):
        try:
            out.append(canonical_key(h))
        except (TypeError, ValueError) as e:
            where = f"leaf {leaf!r} " if leaf is not None else ""
            raise type(e)(f"{where}block_hashes[{i}]: {e}") from None
    return out


def _window_of(group: KVCacheGroupId) -> Optional[int]:
    return int(group.window_size) if group.is_sliding_window() else None


def _shape_of(group: KVCacheGroupId) -> str:
    return f"{group.type}:{group.window_size}"


def _wait_quietly(f: Future) -> None:
    try:
        f.result()
    except BaseException:  # cancelled or failed: either way it no longer runs
        pass


# --- MAX wiring ---------------------------------------------------------------------------------
def _page_tables(leaf: str, replica: int, mem: Any) -> LeafMemory:
    """A leaf's ``KVCacheMemory`` as zero-copy torch views of its ``[num_pages, bytes_per_page]``
    uint8 buffers; ``ValueError`` naming the leaf, replica and shard of one that cannot be viewed
    without a copy (``gdskv.streams.zero_copy_view``)."""
    views = tuple(streams.zero_copy_view(b, f"gdskv MAX connector: leaf {leaf!r} replica {replica} shard {s}")
                  for s, b in enumerate(mem.buffers))
    return LeafMemory(views, bool(mem.replicated))


def model_identity(cfg: GdsKvConfig) -> str:
    """The model part of the namespace: ``model_id`` from the config, else ``GDSKV_MAX_MODEL``.

    Raises ``ConfigError`` naming the setting when neither is set: KV must never be shared
    between models whose pages happen to have the same geometry."""
    model = cfg.model_id or os.environ.get(ENV_MODEL)
    if not model:
        raise ConfigError(f"gdskv config: model_id must be set for MAX (in the TOML named by GDSKV_CONFIG, "
                          f"or {ENV_MODEL}; python -m gdskv.connectors.max_launch sets it from --model-path)")
    return model


def model_from_argv(argv: Sequence[str]) -> Optional[str]:
    """The value of ``--model-path`` / ``--model`` in a MAX command line, or None. A local
    directory is made absolute, so the namespace does not depend on the working directory.
    Called by ``gdskv.connectors.max_launch``."""
    for i, arg in enumerate(argv):
        for flag in ("--model-path", "--model"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            return os.path.abspath(value) if os.path.isdir(value) else value
    return None


def create_gdskv_connector(leaves: Mapping[str, KVCacheGroupId], devices: Sequence[Any],
                           replica_kv_memory: Sequence[Mapping[str, Any]], params: Any,
                           device_memory_bytes: int) -> GdsKvConnector:
    """MAX's ``create_connector`` signature, building a ``GdsKvConnector`` from gdskv's config.

    Called by MAX's Jenga cache manager (through ``install()``) once, at bring-up."""
    cfg = load_config()
    algo = str(getattr(params, "kv_hash_algo", "ahash64"))
    seed = getattr(params, "kv_hash_seed", None)
    if algo == "sha256" and seed is None:
        log.warning("gdskv: --kv-cache-hash-algo sha256 without --kv-cache-hash-seed draws a random seed per "
                    "process, so no block stored by one process is ever found by another")
    extra = {
        "kv_hash_algo": algo,
        "kv_hash_seed": "none" if seed is None else hashlib.sha256(bytes(seed)).hexdigest()[:16],
        "num_layers": str(getattr(params, "num_layers", "")),
    }
    memory = [{leaf: _page_tables(leaf, r, mem) for leaf, mem in replica.items() if leaf in leaves}
              for r, replica in enumerate(replica_kv_memory)]
    dtype = getattr(params.dtype, "name", str(params.dtype))
    return GdsKvConnector(leaves, memory, model=model_identity(cfg), dtype=dtype,
                          tokens_per_block=int(params.page_size), config=cfg, extra=extra,
                          stats_file=os.environ.get(ENV_METRICS), engine_streams=streams.engine_streams(devices))


_installed: Optional[Callable[..., Any]] = None


def install() -> None:
    """Make MAX's Jenga cache manager use ``GdsKvConnector`` for any non-null connector type.

    MAX 26.7 has no plugin hook for third-party connectors, so this replaces
    ``max.pipelines.kv_cache.paged_kv_cache.jenga_cache_manager.create_connector``; MAX keeps
    the connector only when ``--kv-connector-config`` names a non-null type (use
    ``'{"type":"rust_tiered"}'``). With the null type MAX's own factory still runs. Idempotent.
    Called at import by ``gdskv.connectors.max_launch`` (so a spawned model worker gets it too),
    or by a script before it builds a MAX pipeline.
    """
    global _installed
    from max.nn.kv_cache.cache_params import KVConnectorType
    from max.pipelines.kv_cache.paged_kv_cache import jenga_cache_manager as jcm

    if _installed is not None and jcm.create_connector is _installed:
        return
    original = jcm.create_connector

    def create_connector(leaves: Any, devices: Any, replica_kv_memory: Any, params: Any, device_memory_bytes: int) -> Any:
        if params.kv_connector_config.type == KVConnectorType.null:
            return original(leaves, devices, replica_kv_memory, params, device_memory_bytes)
        return create_gdskv_connector(leaves, devices, replica_kv_memory, params, device_memory_bytes)

    jcm.create_connector = create_connector
    _installed = create_connector


def install_if_requested() -> None:
    """Install the hook when ``GDSKV_MAX_HOOK=1`` and MAX imports; otherwise do nothing.

    MAX's offline ``LLM`` runs the model in a worker started with ``spawn``, which re-imports the
    parent's main module; a main module that calls this at import (``gdskv.cli.main``) thus
    gives that worker the hook its parent installed (``gdskv prewarm --engine max``)."""
    if os.environ.get(ENV_HOOK) != "1":
        return
    try:
        install()
    except ImportError:
        log.warning("gdskv: %s=1 but MAX does not import here; no connector hook", ENV_HOOK)
