"""MAX's page memory and block names as gdskv sees them, checked at MAX's boundary.

- ``LeafMemory``: one leaf's pages on one DP replica, one ``[num_pages, bytes_per_page]`` uint8
  tensor per TP shard (``page_tables`` views MAX's ``KVCacheMemory`` that way, zero-copy);
- ``Pools``: every replica's memory for the leaves a connector serves, validated against them,
  with the store namespace that identifies the KV (leaves are layer groups: sorted leaf ids
  numbered 0, 1, ...; ids and attention shapes are part of the namespace) and the arguments of
  ``load`` / ``offload`` checked and paired;
- ``canonical_keys``: MAX's block hashes (8 big-endian bytes for ahash64, 32 for SHA-256) as
  block keys, as given (``gdskv.keys.canonical_key``).

Where a leaf's chunks live and come from is ``gdskv.planner.store_shards`` / ``shard_routes``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gdskv import planner, streams
from gdskv.connectors.max.types import KVCacheGroupId
from gdskv.keys import canonical_key
from gdskv.store import GroupSpec, NamespaceSpec


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


def page_tables(leaf: str, replica: int, mem: Any) -> LeafMemory:
    """A leaf's ``KVCacheMemory`` as zero-copy torch views of its ``[num_pages, bytes_per_page]``
    uint8 buffers; ``ValueError`` naming the leaf, replica and shard of one that cannot be viewed
    without a copy (``gdskv.streams.zero_copy_view``)."""
    views = tuple(streams.zero_copy_view(b, f"gdskv MAX connector: leaf {leaf!r} replica {replica} shard {s}")
                  for s, b in enumerate(mem.buffers))
    return LeafMemory(views, bool(mem.replicated))


def canonical_keys(hashes: Iterable[bytes], leaf: Optional[str] = None) -> list[bytes]:
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


class Pools:
    """Every DP replica's page memory for the leaves one connector serves (``memory[replica][leaf]``).

    Raises ``ValueError`` naming the leaf (and replica) for memory that does not describe the
    leaves: a leaf without memory, another page geometry on another replica, leaves with
    different TP degrees."""

    def __init__(self, leaves: Mapping[str, KVCacheGroupId], replica_memory: Sequence[Mapping[str, LeafMemory]]) -> None:
        if not leaves:
            raise ValueError("gdskv MAX connector: no leaves to serve")
        if not replica_memory:
            raise ValueError("gdskv MAX connector: no replica memory")
        self.leaves: dict[str, KVCacheGroupId] = dict(leaves)
        self.memory = [dict(m) for m in replica_memory]
        self.gid = {leaf: i for i, leaf in enumerate(sorted(self.leaves))}
        """The store layer group of each leaf."""
        first = self.memory[0]
        tp_size = 0
        for r, mem in enumerate(self.memory):
            for leaf in self.leaves:
                if leaf not in mem:
                    raise ValueError(f"gdskv MAX connector: replica {r} has no memory for leaf {leaf!r}")
                m, m0 = mem[leaf], first[leaf]
                if (len(m.shards), m.bytes_per_page, m.replicated) != (len(m0.shards), m0.bytes_per_page, m0.replicated):
                    raise ValueError(f"gdskv MAX connector: leaf {leaf!r} has another page geometry on replica {r}")
                tp_size = tp_size or len(m.shards)
                if len(m.shards) != tp_size:
                    raise ValueError(f"gdskv MAX connector: leaf {leaf!r} has {len(m.shards)} TP shards, other leaves {tp_size}")
        self.tp_size = tp_size

    def spec(self, model: str, dtype: str, tokens_per_block: int, extra: Optional[Mapping[str, str]]) -> NamespaceSpec:
        """The namespace of shard 0 (``with_rank(r)`` for shard ``r``): the model's identity and
        every leaf's id, attention shape and page size (``namespace_leaves``), plus ``extra``."""
        first = self.memory[0]
        groups = tuple(GroupSpec(gid, first[leaf].bytes_per_page, (), _window_of(self.leaves[leaf]))
                       for leaf, gid in self.gid.items())
        ident = {"engine": "max", "leaves": self.namespace_leaves} | dict(extra or {})
        return NamespaceSpec(model, dtype, int(tokens_per_block), groups, 0, self.tp_size,
                             extra=tuple(sorted((str(k), str(v)) for k, v in ident.items())))

    @property
    def namespace_leaves(self) -> str:
        return ";".join(f"{gid}={leaf}={_shape_of(self.leaves[leaf])}" for leaf, gid in self.gid.items())

    def tensors(self) -> list[torch.Tensor]:
        """Every page tensor of every replica, leaf and shard (registered with the I/O engine)."""
        return [t for mem in self.memory for lm in mem.values() for t in lm.shards]

    def replica(self, replica_idx: int) -> dict[str, LeafMemory]:
        if not isinstance(replica_idx, int) or not 0 <= replica_idx < len(self.memory):
            raise ValueError(f"replica_idx {replica_idx!r} outside [0, {len(self.memory)})")
        return self.memory[replica_idx]

    def store_shards(self, leaf: str) -> range:
        """The shards whose namespaces hold ``leaf``'s chunks (shard 0 alone when replicated)."""
        return planner.store_shards(self.tp_size, self.memory[0][leaf].replicated)

    def routes(self, leaf: str) -> list[tuple[int, range]]:
        """``(source shard, destination shards)`` of a load of ``leaf``."""
        return planner.shard_routes(self.tp_size, self.memory[0][leaf].replicated)

    def chained(self, leaf: str) -> bool:
        """Whether ``leaf``'s blocks form a prefix chain (not a recurrent state's checkpoints)."""
        return not self.leaves[leaf].is_recurrent()

    def pairs(self, block_ids: Mapping[str, Sequence[int]],
              block_hashes: Mapping[str, Sequence[bytes]]) -> dict[str, list[tuple[int, bytes]]]:
        """``{leaf: [(block id, key), ...]}`` for every leaf, after checking the arguments of
        ``load`` / ``offload``: leaves are ours, ids and hashes pair up, hashes are canonical."""
        unknown = (set(block_ids) | set(block_hashes)) - set(self.leaves)
        if unknown:
            raise ValueError(f"unknown leaf id(s) {sorted(unknown)}; this connector serves {sorted(self.leaves)}")
        out: dict[str, list[tuple[int, bytes]]] = {}
        for leaf in self.leaves:
            ids = list(block_ids.get(leaf, ()))
            hashes = list(block_hashes.get(leaf, ()))
            if len(ids) != len(hashes):
                raise ValueError(f"leaf {leaf!r}: {len(ids)} block ids but {len(hashes)} block hashes")
            out[leaf] = list(zip((int(b) for b in ids), canonical_keys(hashes, leaf)))
        return out
