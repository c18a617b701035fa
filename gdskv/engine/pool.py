"""The reference engine's paged KV cache: layer groups, page pools per TP rank, the allocator.

Layers are grouped by attention window (one group per distinct window, numbered in order of
first appearance), and each group has its own pool on every rank, so a page index is scoped to
its group exactly as in TensorRT-LLM under VSWA. A pool is a contiguous tensor with page slot as
dim 0; by default one tensor per group shaped ``[num_slots, num_layers_in_group, 2,
tokens_per_block * kv_heads_on_rank * head_dim]`` (K then V, each ``[kv_heads, tokens, head_dim]``),
or with ``split_kv_regions`` a K tensor and a V tensor (two regions per group).

Who calls what: ``ReferenceEngine`` builds one ``PagedKvCache`` at start-up, hands
``layouts[rank]`` to each connector worker, allocates and frees slots through ``allocator``, and
gives the model a ``RequestKv`` per request and step. Page indices reach a tensor only through
``_checked_slot``: a ``-1`` (``BAD_PAGE_INDEX``) is never used as a subscript.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from gdskv.engine.config import EngineConfig, ModelConfig
from gdskv.layout import (
    BAD_PAGE_INDEX,
    GroupPools,
    KvCacheBufferRef,
    KvCacheLayout,
    layout_from_group_tensors,
    single_pool_layout,
    valid_page_slots,
)

POISON_BYTE = 0xFF
"""Fill of a poisoned slot: all-ones bytes are NaN in float32, bfloat16 and float16."""


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing an attention window, hence a page index space."""

    layer_group_id: int
    window_size: Optional[int]
    layer_ids: tuple[int, ...]

    def passed_blocks(self, block_ids: Sequence[int], num_computed: int, tokens_per_block: int) -> list[int]:
        """Ordinals holding a page that no query from position ``num_computed`` on can attend to."""
        if self.window_size is None:
            return []
        first_visible = num_computed - self.window_size + 1
        return [b for b, _ in valid_page_slots(block_ids) if (b + 1) * tokens_per_block <= first_visible]


def layer_groups_of(cfg: ModelConfig) -> list[LayerGroup]:
    """Group the model's layers by attention window, in order of first appearance."""
    order: list[Optional[int]] = []
    members: dict[Optional[int], list[int]] = {}
    for layer in range(cfg.num_layers):
        w = cfg.window_of_layer(layer)
        if w not in members:
            order.append(w)
            members[w] = []
        members[w].append(layer)
    return [LayerGroup(gid, w, tuple(members[w])) for gid, w in enumerate(order)]


class BlockAllocator:
    """Free lists of page slots, one per layer group. LIFO, so freed slots are reused first."""

    def __init__(self, slots_per_group: Sequence[int], reserved_last_slot: bool) -> None:
        self.capacity = [n - 1 if reserved_last_slot else n for n in slots_per_group]
        self._free = [list(range(cap - 1, -1, -1)) for cap in self.capacity]

    def num_free(self, layer_group_id: int) -> int:
        return len(self._free[layer_group_id])

    def allocate(self, layer_group_id: int) -> int:
        """A free slot of the group; the caller reserved capacity, so running out is a bug."""
        if not self._free[layer_group_id]:
            raise RuntimeError(f"layer group {layer_group_id}: no free page slot (reservation bookkeeping is wrong)")
        return self._free[layer_group_id].pop()

    def free(self, layer_group_id: int, slot: int) -> None:
        if not 0 <= slot < self.capacity[layer_group_id] or slot in self._free[layer_group_id]:
            raise RuntimeError(f"layer group {layer_group_id}: freeing slot {slot} that is not allocated")
        self._free[layer_group_id].append(slot)


@dataclass
class _GroupPool:
    """One layer group's pool on one rank, with K and V views ``[slots, layers, heads, tokens, dim]``."""

    tensors: list[torch.Tensor]
    k: torch.Tensor
    v: torch.Tensor


class PagedKvCache:
    """Every rank's pools, their layouts, and the shared slot allocator.

    Slot ``s`` of group ``g`` is allocated on all ranks at once (ranks hold different KV heads of
    the same tokens), so one block table per request serves every rank.
    """

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        if model_cfg.num_kv_heads % engine_cfg.tp_size:
            raise ValueError(f"num_kv_heads={model_cfg.num_kv_heads} does not split across tp_size={engine_cfg.tp_size}")
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        self.tokens_per_block = engine_cfg.tokens_per_block
        self.groups = layer_groups_of(model_cfg)
        self._where = {layer: (g.layer_group_id, i) for g in self.groups for i, layer in enumerate(g.layer_ids)}
        self.heads_per_rank = model_cfg.num_kv_heads // engine_cfg.tp_size
        slots = [engine_cfg.slots_of_group(g.layer_group_id, len(self.groups)) for g in self.groups]
        if min(slots) < (2 if engine_cfg.poison_last_slot else 1):
            raise ValueError(f"num_slots={engine_cfg.num_slots} leaves a layer group without a usable slot")
        self.allocator = BlockAllocator(slots, engine_cfg.poison_last_slot)
        self.pools = [[self._make_pool(g, n) for g, n in zip(self.groups, slots)] for _ in range(engine_cfg.tp_size)]
        self.layouts = [self._make_layout(rank_pools) for rank_pools in self.pools]
        if engine_cfg.poison_last_slot:
            for rank_pools in self.pools:
                for pool in rank_pools:
                    for t in pool.tensors:
                        t[-1].view(torch.uint8).fill_(POISON_BYTE)

    # -- construction -----------------------------------------------------------------------

    def _make_pool(self, group: LayerGroup, num_slots: int) -> _GroupPool:
        heads, tpb, d = self.heads_per_rank, self.tokens_per_block, self.model_cfg.head_dim
        nl, dtype = len(group.layer_ids), self.model_cfg.cache_dtype
        if self.engine_cfg.split_kv_regions:
            k, v = (torch.zeros(num_slots, nl, heads * tpb * d, dtype=dtype) for _ in range(2))
            return _GroupPool([k, v], k.view(num_slots, nl, heads, tpb, d), v.view(num_slots, nl, heads, tpb, d))
        pool = torch.zeros(num_slots, nl, 2, heads * tpb * d, dtype=dtype)
        kv = pool.view(num_slots, nl, 2, heads, tpb, d)
        return _GroupPool([pool], kv[:, :, 0], kv[:, :, 1])

    def _make_layout(self, rank_pools: list[_GroupPool]) -> KvCacheLayout:
        tpb, dtype = self.tokens_per_block, self.model_cfg.cache_dtype
        if len(self.groups) == 1 and self.groups[0].window_size is None and not self.engine_cfg.split_kv_regions:
            return single_pool_layout(rank_pools[0].tensors[0], tpb)
        specs = []
        for group, pool in zip(self.groups, rank_pools):
            if self.engine_cfg.split_kv_regions:
                buffers = [[KvCacheBufferRef(layer, role) for layer in group.layer_ids] for role in ("key", "value")]
            else:
                buffers = [[KvCacheBufferRef(layer, role) for layer in group.layer_ids for role in ("key", "value")]]
            specs.append(GroupPools(group.window_size, group.layer_ids, pool.tensors, buffers))
        layout = layout_from_group_tensors(specs, tpb, dtype)
        if len(self.groups) == 1 and not self.engine_cfg.split_kv_regions:
            # One sliding window for every layer: still one pool tensor, which is what a connector
            # that only implements register_kv_caches receives (see the spec's "Serving a prefix").
            layout = dataclasses.replace(layout, _single_pool=rank_pools[0].tensors[0])
        return layout

    # -- called by the scheduler loop -------------------------------------------------------

    def group_of_layer(self, layer: int) -> tuple[int, int]:
        """``(layer_group_id, index of the layer inside its group's pool)``."""
        return self._where[layer]

    def request_kv(self, block_ids: list[list[int]]) -> "RequestKv":
        """The model's view of one request's pages (``block_ids[g][ordinal]``, -1 for no page)."""
        return RequestKv(self, block_ids)

    def page_bytes(self, rank: int, layer_group_id: int, slot: int) -> bytes:
        """The bytes of one page slot, regions concatenated in region order."""
        self._checked_slot(layer_group_id, slot)
        return b"".join(t[slot].contiguous().view(torch.uint8).numpy().tobytes() for t in self.pools[rank][layer_group_id].tensors)

    def poison_intact(self) -> bool:
        """Whether every pool's last slot still holds only ``POISON_BYTE`` (needs ``poison_last_slot``)."""
        if not self.engine_cfg.poison_last_slot:
            raise RuntimeError("poison_intact needs EngineConfig(poison_last_slot=True)")
        return all(
            bool((t[-1].view(torch.uint8) == POISON_BYTE).all())
            for rank_pools in self.pools for pool in rank_pools for t in pool.tensors
        )

    def _checked_slot(self, layer_group_id: int, slot: int) -> int:
        if not 0 <= slot < self.allocator.capacity[layer_group_id]:
            raise IndexError(f"layer group {layer_group_id}: page index {slot} does not address an allocatable slot")
        return slot


class RequestKv:
    """``KvAccess`` over one request's block table: positions → (slot, offset) on every rank."""

    def __init__(self, cache: PagedKvCache, block_ids: list[list[int]]) -> None:
        self._cache, self._block_ids = cache, block_ids

    def write(self, layer: int, positions: Sequence[int], k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> None:
        c = self._cache
        gid, li = c.group_of_layer(layer)
        hpr, tpb, dtype = c.heads_per_rank, c.tokens_per_block, c.model_cfg.cache_dtype
        for pos, k_row, v_row in zip(positions, k, v):
            slot = c._checked_slot(gid, self._block_ids[gid][pos // tpb])
            for rank, rank_pools in enumerate(c.pools):
                heads = slice(rank * hpr, (rank + 1) * hpr)
                rank_pools[gid].k[slot, li, :, pos % tpb] = k_row[heads].to(dtype)
                rank_pools[gid].v[slot, li, :, pos % tpb] = v_row[heads].to(dtype)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        gid, li = c.group_of_layer(layer)
        tpb, d = c.tokens_per_block, c.model_cfg.head_dim
        gone = None  # one NaN block for every reclaimed one (torch.cat copies it)
        ks, vs = [], []
        for ordinal in range(-(-end // tpb)):
            slot = self._block_ids[gid][ordinal]
            if slot == BAD_PAGE_INDEX:
                if gone is None:
                    gone = torch.full((c.model_cfg.num_kv_heads, tpb, d), float("nan"), dtype=c.model_cfg.dtype)
                ks.append(gone)
                vs.append(gone)
                continue
            c._checked_slot(gid, slot)
            ks.append(torch.cat([rank_pools[gid].k[slot, li] for rank_pools in c.pools]).to(c.model_cfg.dtype))
            vs.append(torch.cat([rank_pools[gid].v[slot, li] for rank_pools in c.pools]).to(c.model_cfg.dtype))
        return torch.cat(ks, dim=1)[:, :end], torch.cat(vs, dim=1)[:, :end]
