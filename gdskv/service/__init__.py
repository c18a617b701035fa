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

The package: ``core`` (``KvService``: bring-up, state, close), ``lookups``, ``loads``, ``saves``,
``hostkeep`` (the host tier's side of loads and saves), ``counting`` (the counters and their
flushes), ``lineage`` (links learnt from an engine's runs of block keys) and ``paced`` (a long
asynchronous load posted a slice per step).
"""
from gdskv.service.core import LEASE_SECONDS, KvService, ServiceSetupError
from gdskv.service.counting import ServiceCounters
from gdskv.service.lineage import LINEAGE_CAPACITY, Lineage
from gdskv.service.loads import HIT_COPY_THREADS, HOST_COPY_THREADS

__all__ = ["HIT_COPY_THREADS", "HOST_COPY_THREADS", "LEASE_SECONDS", "LINEAGE_CAPACITY", "KvService", "Lineage",
           "ServiceCounters", "ServiceSetupError"]
