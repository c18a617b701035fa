"""The store: a Zarr v3 hierarchy of KV pages on a local (or shared) file system.

``<root>/zarr.json``                 root group; attribute ``gdskv`` marks a gdskv store
``<root>/ns/<ns_id>/zarr.json``      one group per namespace; attribute ``gdskv_namespace``
``<root>/ns/<ns_id>/g<gid>/``        one uint8 array per layer group, one chunk per block
``<root>/.gdskv/quarantine/``        chunks that failed verification, moved aside
``<root>/.gdskv/stats/``             per-process counter files (``gdskv stats`` sums them)
``<root>/.gdskv/lock``               advisory lock for metadata changes (never the data path)

``.gdskv`` is the one entry plain zarr does not recognise (``tree()`` warns about it once).

The store is the source of truth: presence is a file, recency is the file's mtime, and nothing
else has to be rebuilt after a restart or shared with another process. Page bytes never go through
Zarr's codec pipeline: ``gdskv.transfer`` writes and reads chunk files directly, in a layout that
plain ``zarr`` reads (``arr[hi, :bytes_per_page, lo]`` is the page; see FORMAT.md).

Called by connectors at bring-up (``PageStore.open``, ``store.namespace(spec)``), by the planner's
lookups (``contains_many``), by the transfer layer (``chunk_path``, ``quarantine``), and by the CLI.

The package: ``spec`` (what makes KV incompatible), ``namespace`` (a namespace's chunks, presence,
recency, leases), ``core`` (``PageStore``: open, namespaces, quarantine, stats), ``walk`` (the one
walk of the tree), ``tree`` (its names and Zarr metadata), ``counters`` and ``capacity`` (the
budget a store accepts).
"""
from gdskv.store.capacity import CapacityBudget
from gdskv.store.core import PageStore, StoreError, StoreUnreadable
from gdskv.store.counters import Counters
from gdskv.store.namespace import STORE_KEY_CACHE, Namespace
from gdskv.store.spec import MAX_PAGE_BYTES, GroupSpec, NamespaceSpec
from gdskv.store.tree import GROUP_DIR, NAMESPACE_ATTR, NAMESPACE_ID, PRIVATE_DIR, STORE_ATTR, is_store
from gdskv.store.walk import ArrayDir, ChunkEntry

__all__ = ["GROUP_DIR", "MAX_PAGE_BYTES", "NAMESPACE_ATTR", "NAMESPACE_ID", "PRIVATE_DIR", "STORE_ATTR", "STORE_KEY_CACHE",
           "ArrayDir", "CapacityBudget", "ChunkEntry", "Counters", "GroupSpec", "Namespace", "NamespaceSpec", "PageStore",
           "StoreError", "StoreUnreadable", "is_store"]
