"""Capacity-bounded, prefix-aware, recency-based eviction (FORMAT.md, "Capacity, recency and eviction",
is the prose version).

Modules, each usable on its own (``gdskv.eviction`` re-exports their names, so
``from gdskv.eviction import ...`` works as before the split):

- **Policy** (``policy.py``) — pure functions over plain data (``ChunkTable`` columns, or a list of ``ChunkInfo``):
  ``eviction_order`` ranks chunks, ``select_victims`` / ``pick_victims`` cut the ranking at a byte
  count or an age, ``shortfall`` says how many bytes a save must free first. A chunk's
  *effective recency* is the newest mtime among it and every stored descendant (chunks whose
  parent-key chain leads to it, same namespace and layer group); chunks go in increasing effective
  recency, deeper first on ties. Every prefix of that order removes a block only together with all
  of its stored descendants, so a stored block is never left without its stored ancestors. Pinned
  chunks (and, through them, their ancestors) never go.
- **Index** (``index.py``) — ``scan_store`` lists the chunk files through the store's one walker
  (``PageStore.arrays`` / ``chunk_entries``: real directories only, never a link) and attaches
  each chunk's parent. Only regular files named by their chunk index are chunks; links, FIFOs and
  other entries are never opened, counted or removed. Every array on disk is scanned, those of
  namespaces with damaged metadata too (their chunks use space and stay evictable). Parents come
  from the chunk trailers, cached per array under ``<root>/.gdskv/index/`` (``<ns_id>.g<gid>.npy``:
  chunk index, inode, parent chunk index), so a trailer is read once per chunk file, not once per
  scan.
- **Removal** (``removal.py``) — ``remove_chunks``: every file operation goes through ``store.fs`` (confined to the
  store's root). A chunk is renamed to a doomed temp name first, then removed only if no lease
  landed on it before the rename (a lease after it fails, so the lookup promises nothing).
- **Catalog** (``catalog.py``, ``journal.py``, ``intents.py``) — the chunk index: a snapshot of
  every chunk (array, chunk index, parent, size, mtime) under ``<root>/.gdskv/index/`` plus
  per-process append-only journals of what was published, used and removed since. ``totals``
  counts a store of any size in milliseconds, ``read`` gives the rows the policy ranks;
  ``rebuild_catalog`` (``index.py``) remakes it from a walk. The chunk files stay the truth:
  removal re-checks each file (lease, mtime), and a walk heals whatever a crash kept out of the
  journals. A save journals its intent before its rename, so the chunks of a process killed
  between a rename and its record are looked at (one ``lstat`` each) by the next count of any
  process, not left for the walk.
- **Budget** (``budget.py``) — ``Budget`` implements the hook ``PageTransfer`` calls on ``store.budget``
  (``admit`` / ``on_publishing`` / ``on_published`` / ``pin`` / ``unpin``); ``install_budget(store, cfg)``
  sets it at bring-up in every process that writes chunks (without a byte budget or a free-space
  floor it only keeps the chunk index).

Recency is the chunk file's mtime: loads (``PageTransfer``) and lookups (``Namespace.touch_many``)
refresh it, so it survives restarts and is shared by every process on the store. Callers: the
connectors and the demo (``install_budget`` at bring-up), ``PageTransfer`` (the hook),
``gdskv info`` (``catalog.totals``) and ``gdskv evict`` / ``gdskv ls`` (``scan_store``,
``select_victims``, ``remove_chunks``).
"""
from __future__ import annotations

from gdskv.eviction.budget import (
    INFLIGHT_TTL_S,
    Budget,
    DiskUsage,
    disk_usage,
    install_budget,
)
from gdskv.eviction import catalog
from gdskv.eviction.index import (
    INDEX_DIR,
    chunk_index_of,
    namespace_ids_matching,
    read_trailer,
    rebuild_catalog,
    scan_store,
)
from gdskv.eviction.policy import (
    NO_PARENT,
    ArrayRef,
    ChunkInfo,
    ChunkTable,
    Limits,
    depths,
    effective_recency,
    eviction_order,
    no_room,
    pick_victims,
    select_victims,
    shortfall,
)
from gdskv.eviction.removal import Removal, remove_chunk, remove_chunks

__all__ = [
    "NO_PARENT", "INDEX_DIR", "INFLIGHT_TTL_S",
    "ArrayRef", "ChunkInfo", "ChunkTable", "Limits", "Removal", "Budget", "DiskUsage",
    "depths", "effective_recency", "eviction_order", "select_victims", "pick_victims", "shortfall", "no_room",
    "chunk_index_of", "read_trailer", "scan_store", "rebuild_catalog", "namespace_ids_matching", "catalog",
    "remove_chunk", "remove_chunks", "disk_usage", "install_budget",
]
