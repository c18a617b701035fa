"""``KvService``: the engine-neutral KV cache service a connector's process holds.

Bring-up from a config object and a namespace spec, the process's state (store, namespaces,
transfers, host tier, remote tier, metrics) and close; its lookups, loads, saves, host-tier
keeping and counters are in the sibling modules of ``gdskv.service``.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from gdskv.config import GdsKvConfig
from gdskv.eviction import Limits, disk_usage, install_budget, no_room
from gdskv.garbage import collect_in_background
from gdskv.hosttier import HostTier, TierConfigError, tier_bytes
from gdskv.io import IoEngine, make_engine
from gdskv.keys import chain_keys
from gdskv.metrics import ServiceMetrics, attach
from gdskv.planner import Salt
from gdskv.remote import RemoteSetupError, RemoteTier
from gdskv.service.counting import Counting, ServiceCounters
from gdskv.service.hostkeep import HostKeeping
from gdskv.service.lineage import Lineage
from gdskv.service.loads import HOST_COPY_THREADS, Loads
from gdskv.service.lookups import Lookups
from gdskv.service.saves import Saves
from gdskv.store import Namespace, NamespaceSpec, PageStore, StoreError
from gdskv.transfer import PageTransfer

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0
"""How long a lookup's served chunks are leased against eviction (in any process), so the load
that follows finds them."""


class ServiceSetupError(ValueError):
    """A configuration the service cannot serve, found at bring-up; the message names the setting."""


class KvService(Lookups, Loads, Saves, HostKeeping, Counting):
    """gdskv's KV cache service for one process of one deployment.

    ``spec`` describes this process's shard (its ``tp_rank`` among ``tp_size``); lookups check
    every shard's namespace (``spec.with_rank(r)``), loads and saves use this shard's. The KV
    heads are split evenly across TP ranks, so every shard has the same page geometry; a shard
    whose real geometry differed would have another namespace and simply miss.

    ``engine``: the I/O engine (default ``make_engine(cfg)``, then owned and closed by ``close``).
    ``shards``: the TP shards whose pages this process moves (``load``/``save``'s ``shard``);
    default its own, ``spec.tp_rank``. An engine that drives every shard from one process (MAX)
    names them all. ``served_by``: the ``engine`` label of this process's metrics, the serving
    engine whose connector made the service (``trtllm``, ``max``, ``vllm``; ``other`` for
    scripts and tests).
    """

    def __init__(self, cfg: GdsKvConfig, spec: NamespaceSpec, *, transfers: bool = True,
                 lease_seconds: float = LEASE_SECONDS, engine: Optional[IoEngine] = None,
                 shards: Optional[Sequence[int]] = None, served_by: str = "other") -> None:
        if not isinstance(cfg, GdsKvConfig):
            raise TypeError(f"KvService needs a GdsKvConfig, got {type(cfg).__name__}")
        cfg.validate()  # ConfigError naming the setting: a config object changed since it was made
        if cfg.metrics_port and cfg.metrics_port + spec.tp_rank > 65535:
            raise ServiceSetupError(f"gdskv config: metrics_port {cfg.metrics_port}: rank {spec.tp_rank} would serve "
                                    f"its metrics on port {cfg.metrics_port + spec.tp_rank}, past 65535")
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
        """This process's metrics (``metrics_port`` set), labelled ``served_by``."""
        try:
            self.store = PageStore.from_config(cfg)
            self.namespaces = [self.store.namespace(spec.with_rank(r)) for r in range(spec.tp_size)]
            if transfers or cfg.remote is not None:  # a lookup-only service writes no chunk unless it reads through
                install_budget(self.store, cfg)
                self._warn_if_no_room(cfg, spec)
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
        try:
            if cfg.remote is not None:
                try:
                    self.remote = RemoteTier(cfg.remote, auth_key, uploads=transfers, background_nice=cfg.background_nice)
                except RemoteSetupError as e:
                    raise ServiceSetupError(str(e)) from None
                self.remote.start_leftovers([self.namespaces[r] for r in self.transfers])
            self.metrics = attach(self, served_by)
        except BaseException:
            self.close()  # the threads and the engine built so far
            raise
        atexit.register(_flush_at_exit, weakref.ref(self))  # a process that ends without close() keeps its counts
        log.info("gdskv: service for %r shard %d/%d on namespace %s in %s%s", spec.model, spec.tp_rank, spec.tp_size,
                 self.namespace.id, cfg.store_path,
                 f" (I/O: {self.engine.describe()})" if self.engine is not None else " (lookups only)")

    @property
    def active(self) -> bool:
        """Whether the store is usable (lookups can hit)."""
        return bool(self.namespaces)

    @property
    def namespace(self) -> Namespace:
        """This process's own shard (``spec.tp_rank``)."""
        return self.namespaces[self.spec.tp_rank]

    def bytes_per_page(self, group: int) -> int:
        """The bytes of one page of layer group ``group`` (this shard's)."""
        return self.spec.group(group).bytes_per_page

    def _warn_if_no_room(self, cfg: GdsKvConfig, spec: NamespaceSpec) -> None:
        """Log, once at bring-up, capacity limits that leave no room for the smallest page, which
        would drop every save (``gdskv.eviction.no_room``)."""
        limits = Limits.of(cfg)
        if not limits.active:
            return
        try:
            fs_total = disk_usage(cfg.store_path)[0]
        except OSError:  # the budget's own probe says so where it matters
            return
        why = no_room(limits, fs_total, min(g.bytes_per_page for g in spec.groups))
        if why is not None:
            log.warning("gdskv: %s: every save will be dropped; raise the limit in the gdskv config", why)

    def other_geometries(self) -> list[str]:
        """The ids of the store's namespaces for this model and shard with another geometry,
        which no lookup of this service serves from; a connector logs them at bring-up."""
        if self.store is None or not self.namespaces:
            return []
        own = self.namespace.id
        return [o.id for o in self.store.namespaces()
                if o.spec.model == self.spec.model and o.spec.tp_rank == self.spec.tp_rank and o.id != own]

    def keys(self, tokens: Sequence[int], cache_salt: Salt = None, start: int = 0,
             parent: Optional[bytes] = None) -> list[bytes]:
        """Keys of every full block of ``tokens`` from ordinal ``start`` on, each chained on its
        parent's (``parent`` is block ``start - 1``'s key) with ``cache_salt`` mixed in."""
        return chain_keys(tokens, self.tokens_per_block, cache_salt, start=start, parent=parent)

    def register_memory(self, tensors: Sequence[Any]) -> int:
        """Register the engine's page memory with the I/O engine once, at bring-up (cuFile buffer
        registration under GDS; a no-op elsewhere); how many allocations were registered."""
        return self.engine.register_buffers(tensors) if self.transfers and self.engine is not None else 0

    def reap(self) -> None:
        """Finish, on this thread, the saves and asynchronous loads whose pages moved since the
        last call (``PageTransfer.reap``: their bookkeeping, their futures and those futures'
        callbacks). The serving loop calls it between steps (the TensorRT-LLM and vLLM workers,
        before they look at their transfers' futures; MAX's offloads when polled), so no transfer
        thread takes the interpreter from it; uncalled, they finish anyway,
        ``gdskv.transfer.REAP_GRACE`` seconds later, or at once for a caller blocked on a result."""
        for transfer in self.transfers.values():
            transfer.reap()

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


def _flush_at_exit(ref: "weakref.ref[KvService]") -> None:
    """At interpreter exit: write the counter file of a service still alive (never raises)."""
    service = ref()
    if service is not None:
        with contextlib.suppress(Exception):
            service.flush_stats(force=True)
