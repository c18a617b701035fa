"""The Prometheus endpoint of a serving process (a connector's scheduler or worker process).

Off by default. With ``metrics_port`` set in the config, the first ``KvService`` a process brings
up starts one HTTP server for the whole process (``/metrics`` on ``metrics_host``, port
``metrics_port + tp_rank``, so the TP ranks of one node do not collide; ``metrics_port = 0`` picks
a free port and logs it), and every service of the process registers with it (``attach``). A port
that is taken is logged and the process serves without metrics: serving never fails for them.

A scrape reads the counters of every namespace a registered service used (the same counters the
store's ``stats/`` files persist, see ``gdskv.metrics.families``; kept after the service is gone,
so a counter never goes back), the store's size (the byte budget's running figure, else the chunk index or, without one, a scan, at
most once a minute) and its file system's free space, and the latency histograms the services
observe (``ServiceMetrics.observe``).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import Metric

from gdskv.config import ConfigError
from gdskv.metrics.families import LATENCY_BUCKETS, PREFIX, Labels, counter_families, store_gauges

if TYPE_CHECKING:
    from gdskv.service import KvService
    from gdskv.store import Counters, Namespace, PageStore

log = logging.getLogger(__name__)

STORE_SCAN_SECONDS = 60.0
"""How old a scanned store size may be when no budget (a process that only looks up) keeps a running figure."""


@dataclass
class ServiceMetrics:
    """One service's handle on its process's metrics (``KvService.metrics``)."""

    process: "ProcessMetrics"
    engine: str

    def observe(self, op: str, ns: "Namespace", seconds: float) -> None:
        """One ``op`` (``lookup``, ``load`` or ``save``) on ``ns`` took ``seconds``."""
        self.process.latency.labels(self.engine, ns.id, str(ns.spec.tp_rank), op).observe(seconds)


@dataclass
class _StoreSize:
    at: float = float("-inf")
    nbytes: Optional[int] = None
    chunks: Optional[int] = None


@dataclass
class ProcessMetrics:
    """The process's registry, its HTTP server and the services that report through it."""

    port: int
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    counters: dict[int, tuple[Labels, "Counters"]] = field(default_factory=dict)
    """Every registered namespace's counters, by ``id``."""
    stores: "weakref.WeakValueDictionary[int, PageStore]" = field(default_factory=weakref.WeakValueDictionary)
    """Every registered service's store, by ``id`` (a service's store may go before the others')."""
    _sizes: dict[str, _StoreSize] = field(default_factory=dict)
    server: Any = None

    def __post_init__(self) -> None:
        self.latency = Histogram(f"{PREFIX}_operation_seconds", "Latency of lookups, page loads and page saves (from posting to done).",
                                 ["engine", "namespace", "tp_rank", "op"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))

    def register(self, service: "KvService", engine: str) -> None:
        for ns in service.namespaces:
            self.counters.setdefault(id(ns.counters), (Labels(ns.id, ns.spec.model, ns.spec.tp_rank, engine), ns.counters))
        if service.store is not None:
            self.stores[id(service.store)] = service.store

    def collect(self) -> Iterator[Metric]:
        yield from counter_families([(labels, counters.snapshot()) for labels, counters in list(self.counters.values())])
        for store in list(self.stores.values())[:1]:  # one store per process in practice
            yield from self._store_gauges(str(store.root), store)

    def _store_gauges(self, root: str, store: "PageStore") -> list[Metric]:
        from gdskv.eviction import catalog, disk_usage, scan_store

        try:
            total, free = disk_usage(root)
        except OSError:
            total = free = None
        size = self._sizes.setdefault(root, _StoreSize())
        used = getattr(store.budget, "used_bytes", None) if store.budget is not None else None
        if used is not None:
            size.nbytes = used
        elif time.monotonic() - size.at > STORE_SCAN_SECONDS:
            size.at = time.monotonic()
            try:  # the chunk index (milliseconds at any size); a store no writing process indexed has none: walked
                try:
                    summary = catalog.totals(store)
                    size.nbytes, size.chunks = summary.nbytes, summary.chunks
                except catalog.CatalogMissing:
                    table = scan_store(store, with_parents=False)
                    size.nbytes, size.chunks = table.total_bytes, len(table)
            except (OSError, ValueError) as e:
                log.debug("gdskv: metrics: could not size %s: %s", root, e)
        return store_gauges(size.nbytes, free, total, size.chunks)


class _Collector:
    def __init__(self, process: ProcessMetrics) -> None:
        self._process = weakref.ref(process)

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; collect() may name new counters any time

    def collect(self) -> Iterator[Metric]:
        process = self._process()
        if process is not None:
            yield from process.collect()


_lock = threading.Lock()
_process: Optional[ProcessMetrics] = None
_refused: Optional[str] = None  # why this process serves no metrics (logged once)


def attach(service: "KvService", engine: str) -> Optional[ServiceMetrics]:
    """Register ``service`` with this process's metrics, starting the HTTP server on the first
    call; None when ``metrics_port`` is unset or the server could not start (the port is taken);
    ``ConfigError`` when ``metrics_host`` names no address. Called by ``KvService`` at bring-up."""
    global _process, _refused
    cfg = service.cfg
    if cfg.metrics_port is None:
        return None
    with _lock:
        if _process is None and _refused is None:
            port = cfg.metrics_port + service.spec.tp_rank if cfg.metrics_port else 0
            process = ProcessMetrics(port)
            try:
                process.server, _ = start_http_server(port, addr=cfg.metrics_host, registry=process.registry)
            except socket.gaierror as e:  # no such address: a setting to fix, not a port that is taken
                raise ConfigError(f"gdskv config: metrics_host {cfg.metrics_host!r} is not an address of this "
                                  f"machine ({e.strerror or e})") from None
            except OSError as e:
                _refused = f"{cfg.metrics_host}:{port}: {e.strerror or e}"
                log.warning("gdskv: metrics_port: cannot serve metrics on %s; serving without metrics", _refused)
                return None
            process.port = process.server.server_address[1]
            log.info("gdskv: Prometheus metrics on http://%s:%d/metrics", cfg.metrics_host, process.port)
            _process = process
        if _process is None:
            return None
        _process.register(service, engine)
        return ServiceMetrics(_process, engine)


def serving_port() -> Optional[int]:
    """The port this process serves metrics on, or None."""
    return _process.port if _process is not None else None
