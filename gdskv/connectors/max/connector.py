"""``GdsKvConnector``: the KVConnector protocol (MAX's ``max.pipelines.kv_cache.connectors.KVConnector``) over
``gdskv.service.KvService``. Translates MAX's calls and types; the decisions are the planner's
(``held_everywhere``, ``store_shards`` / ``shard_routes``, ``plan_offload``), the store, leases,
lineage and transfers the service's.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from gdskv import streams
from gdskv.config import GdsKvConfig, load_config
from gdskv.connectors.max import lookups
from gdskv.connectors.max.lookups import GdsKvLookup, Lookups
from gdskv.connectors.max.memory import LeafMemory, Pools, canonical_keys
from gdskv.connectors.max.metrics import GdsKvMetrics, Meter, Occupancy
from gdskv.connectors.max.transfers import LoadChunk, offload_work, post_load, post_offload
from gdskv.connectors.max.types import (
    ByteCount,
    CompletedTransfer,
    KVCacheGroupId,
    KVConnectorTransfer,
    KVLoadRefused,
    KVTransfer,
)
from gdskv.io import IoEngine
from gdskv.service import KvService
from gdskv.store import Namespace

log = logging.getLogger(__name__)

CONNECTOR_NAME = "gdskv"


class GdsKvConnector:
    """The KVConnector protocol over a gdskv store.

    Built once per MAX cache manager by ``create_gdskv_connector`` (through ``install()``), or
    directly by tests. Every method is called by MAX's scheduler thread; the work runs on this
    object's threads (loads, lookups, one background thread) and the service's. Thread-safe.
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
        ``make_engine(config)`` (then owned and closed by the service). ``engine_streams``: the
        stream MAX runs on per CUDA device (default: the device's current stream). Raises
        ``ValueError`` naming the leaf for memory that does not describe the leaves."""
        self._pools = Pools(leaves, replica_memory)
        cfg = config if config is not None else load_config()
        spec = self._pools.spec(model, dtype, tokens_per_block, extra)
        self.service = KvService(cfg, spec, engine=engine, shards=range(self._pools.tp_size), served_by="max",
                                 lease_seconds=lookups.LOOKUP_LEASE_SECONDS)
        """The service under this connector: one namespace and one transfer per TP shard."""
        self.service.register_memory(self._pools.tensors())
        self._meter = Meter(stats_file)
        self._lookups = Lookups(self.service, self._pools)
        self._jobs = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="gdskv-max-load")
        self._background = ThreadPoolExecutor(1, thread_name_prefix="gdskv-max-bg")
        self._occupancy = Occupancy(self.service, self._background)
        self._engine_streams = dict(engine_streams or {})
        self._lock = threading.Lock()
        self._closed = False
        log.info("gdskv MAX connector: leaves %s, %d TP shard(s), namespace(s) %s", self._pools.namespace_leaves,
                 self._pools.tp_size, ",".join(ns.id for ns in self.service.namespaces))

    # --- identity ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Connector name, for MAX's logs."""
        return CONNECTOR_NAME

    @property
    def leaves(self) -> Mapping[str, KVCacheGroupId]:
        """The leaves this connector serves, as MAX named them (read by MAX's cache manager,
        which keys ``lookup``'s masks and ``load``/``offload``'s arguments by them)."""
        return dict(self._pools.leaves)

    @property
    def namespaces(self) -> list[Namespace]:
        """The store namespaces, one per TP shard (shard ``r`` is ``namespaces[r]``). For tests
        and tools; MAX does not call it."""
        return list(self.service.namespaces)

    def layer_group(self, leaf_id: str) -> int:
        """The store layer group that holds ``leaf_id``'s pages. For tests and tools."""
        return self._pools.gid[leaf_id]

    # --- presence ----------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: Optional[bytes] = None) -> dict[str, list[bool]]:
        """Which of ``block_hashes`` each leaf holds on every TP shard: one positional mask per
        leaf, ``len(block_hashes)`` long. Holds nothing (not a reservation). ``hint`` is unused
        (it routes dKV peers). Raises ``ValueError``/``TypeError`` for a malformed hash.
        Called by MAX's cache manager when it admits a request (``alloc``), before ``load``."""
        keys = canonical_keys(block_hashes)
        self._pools.replica(replica_idx)
        self.service.lineage.learn(keys)
        self._meter.count(lookups=1)
        return self._lookups.masks(keys)

    def probe(self, block_hashes: Sequence[bytes], replica_idxs: Sequence[int], hint: Optional[bytes] = None) -> list[dict[str, list[bool]]]:
        """What each replica could load, for pricing: the store is replica-agnostic, so every
        entry is the same ``lookup`` answer (one shared mapping; callers only read it), read
        with a ``stat`` per chunk and no lease. Called by MAX's scheduler once per arriving
        request, to weigh DP replicas against each other."""
        keys = canonical_keys(block_hashes)
        for r in replica_idxs:
            self._pools.replica(r)
        masks = self._lookups.masks(keys)
        return [masks for _ in replica_idxs]

    def defers_lookup(self, replica_idx: int = 0) -> bool:
        """True: ``start_lookup`` answers on a background thread (the store may be a shared
        file system where a ``stat`` is a round trip). Asked by MAX's scheduler, which counts
        such lookups against its bound on unanswered ones."""
        return True

    def start_lookup(self, block_hashes: Sequence[bytes], replica_idx: int = 0, hint: Optional[bytes] = None) -> GdsKvLookup:
        """Start a ``lookup`` on a background thread and return its handle at once.

        The chunks it reports are leased in the store (no process evicts them) until
        ``load_lookup`` loads them or ``LOOKUP_LEASE_SECONDS`` pass. Malformed hashes raise
        here, synchronously. Called by MAX's scheduler in place of ``lookup`` (``defers_lookup``
        is True); it holds the request out of the batch until the handle completes."""
        keys = canonical_keys(block_hashes)
        self._pools.replica(replica_idx)
        self.service.lineage.learn(keys)
        self._meter.count(lookups=1)
        return self._lookups.start(keys, replica_idx)

    def abandon_lookup(self, lookup: Any) -> None:
        """Drop a ``start_lookup`` handle (its leases run out on their own). Never raises; safe
        on a handle that has not answered, was loaded from, found nothing, or is not ours.
        Called by MAX's scheduler for a lookup it will not load from; by ``load_lookup``,
        ``poll_transfers`` (expired handles) and ``shutdown`` here."""
        self._lookups.release(lookup)

    def load_lookup(self, lookup: Any, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                    replica_idx: int = 0, hint: Optional[bytes] = None) -> KVTransfer:
        """``load`` out of a completed ``start_lookup``, whose leases still hold what it found.
        Consumes the handle however it exits. Called by MAX's cache manager in place of
        ``load`` when the request's lookup was a ``start_lookup``."""
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

        Every chunk is leased first (against eviction in any process); a replicated leaf's one
        chunk is read once and copied into every shard. Returns a ``CompletedTransfer`` when
        asked for nothing, else a transfer MAX polls. Raises ``KVLoadRefused`` (naming leaf and
        hash) when a chunk is not stored, before anything moves; ``KVLoadFailed`` when the copy
        cannot be posted (connector shut down); ``ValueError``/``TypeError`` for malformed
        arguments (unknown leaf, lengths that differ, bad hash, block id outside the pool)."""
        mem = self._pools.replica(replica_idx)
        plan = self._pools.pairs(block_ids, block_hashes)
        chunks: list[LoadChunk] = [(leaf, self._pools.gid[leaf], key, src, [mem[leaf].page(s, bid) for s in dests])
                                   for leaf, pairs in plan.items() for bid, key in pairs
                                   for src, dests in self._pools.routes(leaf)]
        if not chunks:
            return CompletedTransfer()
        missing = self._lookups.lease_chunks([(leaf, key, src) for leaf, _, key, src, _ in chunks])
        if missing is not None:
            leaf, key, src = missing
            self._meter.count(loads_refused=1)
            where = self.service.namespaces[src].id if self.service.active else "none: the store is unusable"
            raise KVLoadRefused(f"gdskv: leaf {leaf!r} block {key.hex()} is not stored (shard namespace {where}); "
                                "evicted since the lookup?", leaf_id=leaf, block_hash=key)
        blocks = sum(len(pairs) for pairs in plan.values())
        ready = self._ready(p for *_, pages in chunks for p in pages)  # the slots may still be in use
        return post_load(self.service, self._jobs, self._meter, chunks, blocks, ready)

    def offload(self, block_ids: Mapping[str, Sequence[int]], block_hashes: Mapping[str, Sequence[bytes]],
                replica_idx: int = 0) -> KVConnectorTransfer:
        """Write device block ``block_ids[leaf][i]`` under ``block_hashes[leaf][i]``.

        Blocks every shard already stores are skipped; the rest are written in the background and
        published (renamed into place) once their bytes are on disk, each naming its parent
        (the block before it, or what a lookup showed before the run). The transfer's
        ``g0_blocks_per_leaf`` are the blocks it reads, which MAX keeps pinned until it
        completes; a ``CompletedTransfer`` when nothing needed writing. Never fails the caller
        for I/O: a full disk or budget drops the block (``connector_offload_blocks_dropped``).
        Called by MAX's cache manager every step, after ``load``, with the blocks committed since."""
        mem = self._pools.replica(replica_idx)
        work, taken, skipped = offload_work(self.service, self._pools, mem, self._pools.pairs(block_ids, block_hashes))
        self._meter.count(offload_blocks_skipped=skipped)
        if not work:
            return CompletedTransfer()
        ready = self._ready(w[-1] for w in work)  # the step that wrote a block may still be running
        return post_offload(self.service, self._meter, work, taken, ready)

    def touch(self, block_hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Refresh the recency of ``block_hashes`` (root first, in the order given) in every
        leaf and shard, on a background thread. Returns at once and never raises; missing and
        malformed hashes are ignored. Called by MAX's cache manager for the run a request
        reuses (served from device or loaded) and when it releases a request."""
        try:
            self._background.submit(self._touch_job, list(block_hashes))
        except Exception as e:  # shut down, or not a sequence: a missed touch costs a refetch at most
            log.debug("gdskv: touch dropped: %s", e)

    def poll_transfers(self) -> None:
        """Drop the ``start_lookup`` handles nobody took within ``LOOKUP_LEASE_SECONDS``. Called
        by MAX on every drain of its in-flight transfers; cheap; never raises."""
        self._lookups.expire()

    # --- occupancy and metrics ---------------------------------------------------------------
    @property
    def host_byte_count(self) -> ByteCount:
        """gdskv has no host tier: pages go between device memory and disk. Read by MAX's
        cache manager for its occupancy reports, like ``disk_byte_count``."""
        return ByteCount(free=0, total=0)

    @property
    def disk_byte_count(self) -> ByteCount:
        """The store's chunk bytes against its capacity (``metrics.Occupancy``). Read by MAX's
        cache manager for its occupancy reports."""
        return self._occupancy.byte_count()

    @property
    def metrics(self) -> GdsKvMetrics:
        """Counters since the last ``take_metrics``; MAX's cache manager adds them to its own."""
        return self._meter.metrics()

    def take_metrics(self) -> GdsKvMetrics:
        """Read and clear the per-batch counters (``inflight_disk_ops`` is a level, not cleared).
        Called by MAX's cache manager once per batch, from its own ``take_metrics``."""
        return self._meter.take()

    def stats(self) -> dict[str, int]:
        """Lifetime counters of this connector (``metrics.Counts``, and the disk operations in
        flight). Written to ``stats_file`` whenever a transfer settles and at ``shutdown``; for
        tests and tools."""
        return self._meter.stats()

    def reset_prefix_cache(self) -> None:
        """Kept as is: the store is persistent and shared with other processes, so MAX resetting
        its own prefix cache (which calls this) does not erase it (``gdskv evict`` does that on
        purpose)."""

    def shutdown(self) -> None:
        """Wait for in-flight work, drop lookup handles, close threads and the service (and the
        I/O engine when the service made it), persist counters. Idempotent; called by MAX's
        cache manager."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._occupancy.closed = True
        self._lookups.close()
        for pool in (self._jobs, self._background):
            pool.shutdown(wait=True)
        self.service.close()
        self._meter.write()

    # --- internals ---------------------------------------------------------------------------
    def _ready(self, pages: Iterable[torch.Tensor]) -> Optional[streams.Readiness]:
        """The readiness of the engine's work queued so far on the devices of ``pages``."""
        return streams.record_ready(devices={p.device for p in pages}, streams=self._engine_streams)

    def _touch_job(self, hashes: list[bytes]) -> None:
        try:
            keys = canonical_keys(hashes)
        except (TypeError, ValueError) as e:
            log.debug("gdskv: touch ignored: %s", e)
            return
        self.service.lineage.learn(keys)
        self._lookups.touch(keys)
        self._meter.count(touches=1)
