"""gdskv as a TensorRT-LLM KV Cache Connector: ``GdsKvScheduler`` (leader) and ``GdsKvWorker``.

Attach with::

    KvCacheConnectorConfig(connector_module="gdskv.connectors.trtllm",
                           connector_scheduler_class="GdsKvScheduler",
                           connector_worker_class="GdsKvWorker")

and ``kv_cache_config.enable_block_reuse=True``. Store settings come from gdskv's own config
(``GDSKV_CONFIG`` / ``GDSKV_STORE``, see ``gdskv.config``). Both classes are constructed as
``Cls(llm_args)`` and subclass TensorRT-LLM's bases when it is installed (``base``).

Both are thin adapters over ``gdskv.service.KvService`` (bring-up from the config, lookups with
leases across TP shards, page loads and saves, counters); every decision is in ``gdskv.planner``.
The scheduler implements both complete callback sets (flat and per-layer-group); the worker both
registrations (``register_kv_caches`` and ``register_kv_cache_layout``, any number of layer
groups and regions). The parts:

- ``base``: TensorRT-LLM's connector base classes, or stand-ins with the same surface;
- ``deployment``: the settings read from ``llm_args`` (refused by name at bring-up),
  ``StandaloneLlmArgs``, and the process-local registry the two halves share;
- ``layout_check``: the worker's refusal of a layout gdskv cannot describe;
- ``scheduler`` and ``worker``: the two halves.

How the scheduler finds the store namespaces it checks (one per TP rank): each worker derives its
``NamespaceSpec`` from the layout it is registered with and publishes it in a process-local
registry keyed by (store path, model, tp_size). The scheduler runs on rank 0, in the same process
as rank 0's worker, and takes that rank's spec; its service checks every rank's namespace with the
same spec and that rank's ``tp_rank``: TensorRT-LLM splits KV heads evenly, so every rank's page
geometry is the same. If a rank's real geometry ever differed, its namespace would differ too,
and the lookup would find nothing there: a miss, never a wrong load.

Extension for the reference engine (TensorRT-LLM has no such hook): ``GdsKvWorker.get_load_failures``
lists requests whose loaded KV failed verification, so the engine recomputes them. Under TensorRT-LLM
a failed load is logged and counted; the scheduler checks presence at lookup, so it is rare.
"""
from __future__ import annotations

from gdskv.connectors.trtllm.base import TRTLLM_AVAILABLE, KvCacheConnectorScheduler, KvCacheConnectorWorker
from gdskv.connectors.trtllm.deployment import (
    DEFAULT_TOKENS_PER_BLOCK,
    ConnectorSetupError,
    Deployment,
    StandaloneKvCacheConfig,
    StandaloneLlmArgs,
    StandaloneMapping,
)
from gdskv.connectors.trtllm.layout_check import check_layout
from gdskv.connectors.trtllm.scheduler import LOOKUP_LEASE_SECONDS, GdsKvScheduler, SchedulerCounters
from gdskv.connectors.trtllm.worker import GdsKvWorker, WorkerCounters

__all__ = [
    "DEFAULT_TOKENS_PER_BLOCK",
    "LOOKUP_LEASE_SECONDS",
    "TRTLLM_AVAILABLE",
    "ConnectorSetupError",
    "Deployment",
    "GdsKvScheduler",
    "GdsKvWorker",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "SchedulerCounters",
    "StandaloneKvCacheConfig",
    "StandaloneLlmArgs",
    "StandaloneMapping",
    "WorkerCounters",
    "check_layout",
]
