"""gdskv as a Modular MAX KVConnector: MAX's paged KV pool ⇄ gdskv's store.

MAX's cache manager owns the device pages, their allocation and the on-device prefix cache; it
asks a connector which blocks an external tier holds (``lookup``), has it read blocks into pages
(``load``) and write committed pages out (``offload``). ``GdsKvConnector`` answers from gdskv's
store through ``gdskv.service.KvService`` (``docs/max.md`` says how to run it,
MAX's ``max.pipelines.kv_cache.connectors.KVConnector`` is the contract):

- **Leaves are layer groups.** Each leaf MAX names is a layer group of one store namespace (sorted
  leaf ids numbered 0, 1, ...; the ids and their attention shapes are part of the namespace), so
  the leaf is part of every chunk's key.
- **Keys as given.** MAX's canonical block hashes (8 big-endian bytes for ahash64, 32 for
  SHA-256) are the block keys, validated at this boundary with ``gdskv.keys.canonical_key``.
- **TP shards are namespaces.** Shard ``r`` of ``n`` writes to the namespace with
  ``tp_rank=r, tp_size=n``; a block is present only when every shard's chunk is (a replicated
  leaf, e.g. MLA, is stored once, from shard 0, and read into every shard).
- **Loads are all-or-raise.** ``load`` leases every chunk (no process evicts it meanwhile) before
  it posts anything: a missing one raises ``KVLoadRefused`` naming the leaf and the hash. Each
  chunk is read into a scratch buffer and verified (key and checksum) before it is copied into
  its page, so a page never holds unverified bytes; a chunk that fails makes the transfer raise
  ``KVLoadFailed`` from every poll, once nothing is in flight any more. What a ``start_lookup``
  reports is leased the same way until the load.
- **Offloads publish when written.** Chunks are renamed into place only after their bytes are
  written, so a block is visible to ``lookup`` exactly when all its shards landed.
- **Device order.** ``load`` and ``offload`` record a readiness on the engine's stream of each
  page's device when MAX hands the blocks over (``gdskv.streams``); no byte of a page is written
  (load) or read (offload) before it, so kernels queued earlier finish with the slot first. A
  load's copy into its pages has landed before the transfer completes, and MAX reads the pages
  only after it saw that. Device memory is viewed zero-copy or the connector refuses to start.
- **Nothing blocks the scheduler.** Loads, offloads, ``start_lookup`` and ``touch`` run on
  background threads; polls read a flag.

The modules: ``connector`` (``GdsKvConnector``, the protocol), ``lookups`` (masks and
``start_lookup`` handles), ``transfers`` (MAX's transfer objects over the service's loads and
saves), ``memory`` (``LeafMemory``, argument checks), ``metrics`` (MAX's metrics, counters,
occupancy), ``types`` (MAX's types or stand-ins), ``wiring`` (``create_gdskv_connector``,
``install``), ``launch`` (the ``max`` CLI with the hook; ``python -m gdskv.connectors.max_launch``),
``offline`` (MAX's offline ``LLM`` for ``gdskv prewarm``, failing where it would wait).
The names below are imported on first use, so ``python -m gdskv.connectors.max.launch`` can
re-execute the interpreter before anything heavy is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gdskv.connectors.max.connector import CONNECTOR_NAME, GdsKvConnector
    from gdskv.connectors.max.lookups import LOOKUP_LEASE_SECONDS, GdsKvLookup
    from gdskv.connectors.max.memory import LeafMemory
    from gdskv.connectors.max.metrics import GdsKvMetrics
    from gdskv.connectors.max.wiring import (
        ENV_HOOK,
        ENV_METRICS,
        ENV_MODEL,
        create_gdskv_connector,
        install,
        install_if_requested,
        model_from_argv,
        model_identity,
    )

_HOME = {
    "CONNECTOR_NAME": "connector",
    "GdsKvConnector": "connector",
    "GdsKvLookup": "lookups",
    "LOOKUP_LEASE_SECONDS": "lookups",
    "LeafMemory": "memory",
    "GdsKvMetrics": "metrics",
    "ENV_HOOK": "wiring",
    "ENV_METRICS": "wiring",
    "ENV_MODEL": "wiring",
    "create_gdskv_connector": "wiring",
    "install": "wiring",
    "install_if_requested": "wiring",
    "model_from_argv": "wiring",
    "model_identity": "wiring",
}

__all__ = [
    "CONNECTOR_NAME",
    "ENV_HOOK",
    "ENV_METRICS",
    "ENV_MODEL",
    "LOOKUP_LEASE_SECONDS",
    "GdsKvConnector",
    "GdsKvLookup",
    "GdsKvMetrics",
    "LeafMemory",
    "create_gdskv_connector",
    "install",
    "install_if_requested",
    "model_from_argv",
    "model_identity",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
