"""Modular MAX's KVConnector types, or stand-ins with the same names and semantics.

When MAX (``max.pipelines``) is installed, every name below is MAX's own class, so the transfers,
exceptions and metrics that ``gdskv.connectors.max.GdsKvConnector`` hands to MAX's cache manager
are the ones it catches and adds up. Where MAX is not installed (CPU CI, the protocol tests),
small local classes stand in, written from the public KVConnector spec: the same names, the
same constructor arguments, the same fields for what gdskv uses. (``start_lookup``'s handle is
gdskv's own ``GdsKvLookup``: MAX 26.7 defines no ``KVLookup`` type.)

``MAX_AVAILABLE`` says which world this is. Imported by the package's other modules and the tests.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol, runtime_checkable


def _max_importable() -> bool:
    """True when ``max.pipelines`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec("max.pipelines") is not None
    except (ImportError, ValueError):
        return False


MAX_AVAILABLE = _max_importable()

if MAX_AVAILABLE:
    from max.nn.kv_cache import KVCacheGroupId
    from max.nn.kv_cache.metrics import KVCacheMetrics
    from max.pipelines.kv_cache.kv_connector import (
        ByteCount,
        CompletedTransfer,
        KVConnectorTransfer,
        KVLoadFailed,
        KVLoadRefused,
        KVTransfer,
    )
else:

    class KVLoadRefused(Exception):  # type: ignore[no-redef]
        """``load`` declined before moving anything: a block it was asked for is not stored
        (evicted since the lookup) or the copy could not be staged. Names the leaf and the hash
        when one block is to blame. The cache manager serves the request as a miss."""

        def __init__(self, message: str, leaf_id: str | None = None, block_hash: bytes | None = None) -> None:
            super().__init__(message)
            self.leaf_id = leaf_id
            self.block_hash = block_hash

    class KVLoadFailed(Exception):  # type: ignore[no-redef]
        """A load's copy failed (posting it, or after it was posted): its blocks hold no valid
        KV. Raised only once nothing writes into the destination blocks any more."""

    @dataclass(frozen=True, slots=True)
    class ByteCount:  # type: ignore[no-redef]
        """Occupancy of an external tier in bytes; ``ByteCount(0, 0)`` means no such tier."""

        free: int
        total: int

        @property
        def used(self) -> int:
            return self.total - self.free

    @dataclass(frozen=True)
    class KVCacheGroupId:  # type: ignore[no-redef]
        """Which attention pattern a leaf serves (``full``, ``sliding_window`` with a window in
        tokens, ``recurrent``, ``scratch``)."""

        type: Literal["full", "sliding_window", "recurrent", "scratch"]
        window_size: int = -1

        def is_full(self) -> bool:
            return self.type == "full"

        def is_sliding_window(self) -> bool:
            return self.type == "sliding_window"

        def is_recurrent(self) -> bool:
            return self.type == "recurrent"

        @classmethod
        def full(cls) -> "KVCacheGroupId":
            return cls(type="full")

    @dataclass
    class KVCacheMetrics:  # type: ignore[no-redef]
        """The transfer counters of MAX's ``KVCacheMetrics`` that a disk-tier connector fills.

        ``connector_load_failures`` is counted by MAX's cache manager, not by connectors."""

        disk_bytes_read: int = 0
        disk_bytes_written: int = 0
        inflight_disk_ops: int = 0
        connector_loads_refused: int = 0
        connector_load_failures: int = 0
        connector_offload_blocks_dropped: int = 0

        def __add__(self, other: "KVCacheMetrics") -> "KVCacheMetrics":
            names = [f.name for f in fields(KVCacheMetrics)]
            return type(self)(**{n: getattr(self, n) + getattr(other, n) for n in names})

    @runtime_checkable
    class KVTransfer(Protocol):  # type: ignore[no-redef]
        """One connector copy in flight, polled by the cache manager every scheduler step."""

        def is_complete(self) -> bool:
            """Never blocks; raises ``KVLoadFailed`` for a load whose copy failed."""
            ...

        def synchronize(self) -> None:
            """Blocks until the copy settled (drain and shutdown only)."""
            ...

    @runtime_checkable
    class KVConnectorTransfer(KVTransfer, Protocol):  # type: ignore[no-redef]
        """An offload's transfer, which also says which device blocks it pins."""

        @property
        def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
            ...

    class CompletedTransfer:  # type: ignore[no-redef]
        """A transfer with nothing in flight: pins nothing, commits at once."""

        def __init__(self, g0_blocks_per_leaf: Mapping[str, Sequence[int]] | None = None) -> None:
            self._g0 = g0_blocks_per_leaf or {}

        @property
        def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
            return self._g0

        def is_complete(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None


__all__ = [
    "MAX_AVAILABLE",
    "ByteCount",
    "CompletedTransfer",
    "KVCacheGroupId",
    "KVCacheMetrics",
    "KVConnectorTransfer",
    "KVLoadFailed",
    "KVLoadRefused",
    "KVTransfer",
]
