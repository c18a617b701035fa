"""The engine's paged KV pool, described as byte ranges per layer group.

Same names and semantics as TensorRT-LLM's ``kv_cache_layout`` module, so code in gdskv that
takes a layout accepts TensorRT-LLM's own objects (duck-typed on these attributes) as well as
the ones built here from torch tensors on any device, CPU included.

Who calls what:
- engines (TensorRT-LLM, the reference engine) hand a ``KvCacheLayout`` to the worker's
  ``register_kv_cache_layout`` once at bring-up;
- the worker addresses page slot ``i`` of a region with ``region.slot_tensor(i)`` only after the
  index has passed ``valid_page_slots``;
- ``single_pool_layout`` / ``layout_from_group_tensors`` are the builders for tensors we own.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

import torch

BAD_PAGE_INDEX = -1
"""A block ordinal with no page in a layer group (reclaimed by a sliding window, say)."""


def valid_page_slots(page_indices: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Yield ``(block_ordinal, page_slot)`` for every entry that addresses a page.

    Entries equal to ``BAD_PAGE_INDEX`` (or any negative value) are skipped, never yielded: ``-1``
    is a valid Python subscript and would alias the pool's last slot.
    """
    for ordinal, slot in enumerate(page_indices):
        slot = int(slot)
        if slot >= 0:
            yield ordinal, slot


class KvCacheBufferRef(NamedTuple):
    """One buffer inside a region: ``(layer_id, role, expansion)``, role e.g. ``"key"``."""

    layer_id: int
    role: str
    expansion: int = 0


@dataclass(frozen=True)
class KvCacheRegion:
    """A contiguous byte range that repeats once per page slot.

    ``device`` says where the addresses point: ``"cpu"`` (host memory, the default) or a CUDA
    device (``"cuda"``, ``"cuda:1"``). ``_storage`` is a flat uint8 view of the tensor the
    addresses point into, when this process built the layout from a tensor. A region built from a
    raw address and size (memory someone else allocated) has none until it is first viewed: host
    memory is then wrapped zero-copy (ctypes → ``torch.frombuffer``), CUDA memory through an object
    exposing ``__cuda_array_interface__`` (``torch.as_tensor``). Whoever owns that memory keeps it
    alive as long as the region is used.
    """

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[KvCacheBufferRef, ...] = ()
    device: str = "cpu"
    _storage: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _rows: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)
    """``as_tensor()`` (uint8), made on the first ``slot_tensor``: a page's view is then one index."""

    def address_of(self, slot: int) -> int:
        """``base + stride * slot``; raises ``IndexError`` outside ``[0, num_slots)``."""
        self._check_slot(slot)
        return self.base + self.stride * slot

    @property
    def span_bytes(self) -> int:
        """Bytes from ``base`` to the end of the last slot (0 for a region without slots)."""
        return self.stride * (self.num_slots - 1) + self.size if self.num_slots > 0 else 0

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A strided ``[num_slots, size // itemsize]`` view; row ``i`` is page slot ``i``.

        Accepts any subscript, ``-1`` included: prefer ``slot_tensor`` for page indices.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.size % itemsize:
            raise ValueError(f"region size {self.size} is not a multiple of {dtype} itemsize {itemsize}")
        storage = self._storage if self._storage is not None else self._wrap_address()
        if storage.numel() == 0:
            return torch.empty((0, self.size // itemsize), dtype=dtype, device=storage.device)
        flat = torch.as_strided(
            storage, size=(self.num_slots, self.size), stride=(self.stride, 1),
            storage_offset=self.base - storage.data_ptr(),
        )
        return flat.view(dtype)

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The bytes of one page slot; raises ``IndexError`` outside ``[0, num_slots)``. Called
        per page and region by every save and load (``gdskv.transfer.page_segments``)."""
        self._check_slot(slot_id)
        if dtype is not torch.uint8:
            return self.as_tensor(dtype)[slot_id]
        rows = self._rows
        if rows is None:
            rows = self.as_tensor()
            object.__setattr__(self, "_rows", rows)
        return rows[slot_id]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.num_slots:
            raise IndexError(f"page slot {slot} outside [0, {self.num_slots})")

    def _wrap_address(self) -> torch.Tensor:
        """A flat uint8 tensor over ``[base, base + span_bytes)`` without copying, kept as
        ``_storage`` so the next view costs nothing."""
        span = self.span_bytes
        dev = torch.device(self.device)
        if span == 0 or self.base == 0:
            if span:
                raise ValueError("region at address 0")
            flat = torch.empty(0, dtype=torch.uint8, device=dev)
        elif dev.type == "cpu":
            flat = torch.frombuffer((ctypes.c_uint8 * span).from_address(self.base), dtype=torch.uint8)
        elif dev.type == "cuda":
            # Not exercised by the CPU test suite: needs a CUDA device (scripts/gpu_check.py territory).
            if not torch.cuda.is_available():
                raise RuntimeError(f"region on {self.device}, but CUDA is not available in this process")
            flat = torch.as_tensor(_CudaRange(self.base, span), device=dev)
            if flat.data_ptr() != self.base:
                raise RuntimeError(f"region on {self.device}: torch copied the memory instead of viewing it")
        else:
            raise RuntimeError(f"region on {self.device}: gdskv views host and CUDA memory only")
        object.__setattr__(self, "_storage", flat)
        return flat


class _CudaRange:
    """``nbytes`` of CUDA memory at ``ptr``, as ``__cuda_array_interface__`` (version 3) describes
    it, so that ``torch.as_tensor`` views it without a copy. Used by ``KvCacheRegion`` for regions
    built from a raw device address."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    """One layer group: layers sharing an attention window and a page index space."""

    layer_group_id: int
    window_size: Optional[int]
    layer_ids: tuple[int, ...]
    regions: tuple[KvCacheRegion, ...]
    replicated_regions: tuple[int, ...] = ()
    """Indices into ``regions`` whose bytes are identical on every TP rank (e.g. MLA latents)."""

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def num_slots(self) -> int:
        return self.regions[0].num_slots if self.regions else 0


@dataclass(frozen=True)
class KvCacheLayout:
    """The whole paged KV pool of one rank."""

    tokens_per_block: int
    dtype: torch.dtype
    groups: tuple[KvCacheLayerGroupLayout, ...]
    _single_pool: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        for g in self.groups:
            if g.layer_group_id == layer_group_id:
                return g
        raise KeyError(layer_group_id)

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        for g in self.groups:
            if layer_id in g.layer_ids:
                return g
        raise KeyError(layer_id)

    def as_single_pool_tensor(self) -> Optional[torch.Tensor]:
        """The ``[num_blocks, num_layers, kv_factor, block_size]`` view, or ``None``."""
        return self._single_pool


def _region_over(t: torch.Tensor, offset: int, size: int, buffers: Sequence[KvCacheBufferRef]) -> KvCacheRegion:
    """A region over rows of ``t`` (dim 0 = page slot), starting ``offset`` bytes into each row."""
    row_bytes = t.stride(0) * t.element_size()
    return KvCacheRegion(
        base=t.data_ptr() + offset,
        size=size,
        stride=row_bytes,
        num_slots=t.shape[0],
        buffers=tuple(buffers),
        device=str(t.device),
        _storage=_storage_bytes(t),
    )


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat ``uint8`` tensor starting at the storage's first
    byte, so that ``as_strided`` offsets measured from it are absolute (``t`` itself may be a
    view that starts anywhere in its storage: a per-layer pool carved from one allocation)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def single_pool_layout(pool: torch.Tensor, tokens_per_block: int, kv_factor_roles: Sequence[str] = ("key", "value")) -> KvCacheLayout:
    """Describe a ``[num_blocks, num_layers, kv_factor, block_size]`` pool as a one-group layout.

    ``block_size`` is the per-page element count of one (layer, k-or-v) buffer. Called by the worker's
    ``register_kv_caches`` and by engines that own a single pool.
    """
    if pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(f"single pool must be a contiguous 4-D tensor, got shape {tuple(pool.shape)}")
    num_blocks, num_layers, kv_factor, block_size = pool.shape
    roles = list(kv_factor_roles)[:kv_factor] if kv_factor <= len(kv_factor_roles) else [f"kv{i}" for i in range(kv_factor)]
    buffers = [KvCacheBufferRef(layer, roles[k], 0) for layer in range(num_layers) for k in range(kv_factor)]
    row_bytes = num_layers * kv_factor * block_size * pool.element_size()
    region = _region_over(pool, 0, row_bytes, buffers)
    group = KvCacheLayerGroupLayout(0, None, tuple(range(num_layers)), (region,))
    return KvCacheLayout(tokens_per_block, pool.dtype, (group,), _single_pool=pool)


@dataclass
class GroupPools:
    """Input to ``layout_from_group_tensors``: the tensors one layer group's pages live in.

    Each tensor has page slot as dim 0 and is contiguous; all have the same slot count. One tensor
    per region (e.g. a K/V pool and a block-scale pool), ``buffers[i]`` naming what tensor ``i``
    holds.
    """

    window_size: Optional[int]
    layer_ids: Sequence[int]
    tensors: Sequence[torch.Tensor]
    buffers: Sequence[Sequence[KvCacheBufferRef]] = ()
    replicated_regions: Sequence[int] = ()


def layout_from_group_tensors(groups: Sequence[GroupPools], tokens_per_block: int, dtype: torch.dtype) -> KvCacheLayout:
    """Describe several layer groups (VSWA, or regions of differing size) as a layout."""
    out = []
    for gid, gp in enumerate(groups):
        if not gp.tensors:
            raise ValueError(f"layer group {gid} has no tensors")
        slots = {t.shape[0] for t in gp.tensors}
        if len(slots) != 1:
            raise ValueError(f"layer group {gid}: tensors disagree on slot count {sorted(slots)}")
        regions = []
        for i, t in enumerate(gp.tensors):
            if not t.is_contiguous():
                raise ValueError(f"layer group {gid} region {i}: tensor must be contiguous")
            bufs = gp.buffers[i] if i < len(gp.buffers) else ()
            regions.append(_region_over(t, 0, t[0].numel() * t.element_size(), bufs))
        out.append(KvCacheLayerGroupLayout(gid, gp.window_size, tuple(gp.layer_ids), tuple(regions), tuple(gp.replicated_regions)))
    return KvCacheLayout(tokens_per_block, dtype, tuple(out))
