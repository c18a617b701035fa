"""The host-memory tier: a byte-budgeted LRU of verified page payloads in front of the disk.

One ``HostTier`` per ``KvService`` (so per worker process), shared by all its requests. The service
fills it with a page's bytes when a save of that page is published (write-through) and when a
load of it from the disk verified (fill on load; a page in host memory that the page cache served
is not copied again: ``keeps_page_cache_reads``), and serves a later load of the same
``(shard, layer group, block key)`` from it without touching the disk. The disk stays the source
of truth: lookups ask the store, never the tier, and a restart loses nothing but warmth.

What an entry may hold: only the exact payload of its key's chunk, as this process published it
or read and verified it. Chunks are content-addressed and immutable (a key is a hash of the
tokens, their parents and the salt, in a namespace that fingerprints the model and geometry), so
an entry stays correct when the chunk is later evicted or quarantined on disk by another
process; the tier does not need to hear about it (a lookup that no longer finds the chunk on disk
simply never asks for it). An entry is served only into segments of exactly its size.

Memory is pinned where CUDA is present (``torch.cuda.is_available()``; page-locked host memory
makes host/device copies direct and asynchronous), plain host memory elsewhere, carved from slabs
(``gdskv.hostmem``): buffers of evicted entries are reused once nobody reads them.

Called by ``gdskv.service.KvService`` (bring-up: ``tier_bytes``; ``load``/``save``:
``borrow_many``, ``put``, and ``reserve_many``/``settle_many`` for a step's loads from the disk,
which fill each entry's buffer as they fill the page); the copies between an entry and a
page's segments are ``gdskv.copies``'.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import torch

from gdskv.copies import gather, payload_nbytes
from gdskv.hostmem import SlabPool

log = logging.getLogger(__name__)

DEFAULT_HOST_BYTES = 4 << 30
"""``host_bytes`` when the config leaves it unset, unless an eighth of the machine's memory is less
(see ``tier_bytes``). 4 GiB per worker is what peers give a worker by default (vLLM's CPU swap
space, LMCache's local CPU backend: 4-5 GB): the KV of ~32k tokens of an 8B model (bf16), enough
to keep the hot system prompts and shared documents of a worker from the disk."""


SAVE_EVICT_SHARE = 0.25
"""The share of the tier's budget that saves in flight may hold by evicting entries (a full
tier's steady state): within it a save's page is copied into its buffer in the native pass that
seals it; beyond it a save takes only free room, and a page without a buffer is copied in on the
reaping thread when done. So a large batch of saves never empties the tier of what loads are
served from while it writes."""


class TierConfigError(ValueError):
    """``host_bytes`` cannot be served on this machine; the message names the setting."""


def physical_memory() -> Optional[int]:
    """Bytes of memory this machine has, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def tier_bytes(host_bytes: Optional[int]) -> int:
    """The tier's budget for a config's ``host_bytes`` (0: no tier). Unset: ``DEFAULT_HOST_BYTES``
    or an eighth of this machine's memory, whichever is less. A budget larger than the machine's
    memory raises ``TierConfigError`` naming ``host_bytes``. Called once, at the service's bring-up."""
    memory = physical_memory()
    if host_bytes is None:
        return DEFAULT_HOST_BYTES if memory is None else min(DEFAULT_HOST_BYTES, memory // 8)
    if memory is not None and host_bytes > memory:
        raise TierConfigError(f"gdskv config: host_bytes {host_bytes} is more than this machine's memory ({memory} bytes); "
                              "lower it, or 0 for no host tier")
    return host_bytes


@dataclass(frozen=True)
class Put:
    """What a ``put`` did: whether it took the page (``taken``), and what it pushed out of the
    tier to make room (``evicted`` pages of ``evicted_bytes``)."""

    taken: bool = False
    evicted: int = 0
    evicted_bytes: int = 0


class _Entry:
    __slots__ = ("buf", "slab", "readers", "gone")

    def __init__(self, buf: torch.Tensor, slab: Any) -> None:
        self.buf = buf
        self.slab = slab
        self.readers = 0
        self.gone = False
        """Out of the tier while a reader held it: its buffer goes back at the last release."""


class HostTier:
    """A thread-safe LRU of page payloads (flat ``uint8`` host tensors) under a byte budget.

    ``capacity``: bytes of payload the tier holds at most (a page larger than that is never
    held). ``pinned``: allocate page-locked memory (default: where CUDA is available; falls back
    to plain memory, once logged, when pinning fails).
    """

    def __init__(self, capacity: int, pinned: Optional[bool] = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._used = 0
        self._saving = 0
        """Bytes reserved by saves in flight (``reserve_many(saving=True)``), until settled."""
        self._memory = SlabPool(capacity, self.pinned)
        """Where entries' buffers come from and go back to (at most one slab beyond the budget)."""
        self._lock = threading.Lock()

    # -- state ------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes of payload held (entries only; buffers still read after their eviction aside)."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    # -- reads ------------------------------------------------------------------------------------
    def borrow(self, key: Hashable, nbytes: int) -> Optional["Borrowed"]:
        """The payload of ``key`` when the tier holds one of exactly ``nbytes`` (it becomes the most
        recent entry), else None. The buffer is the caller's until ``release()`` (or the end of a
        ``with`` block): an eviction meanwhile never hands it to another entry."""
        return self.borrow_many([key], [nbytes])[0]

    def borrow_many(self, keys: Sequence[Hashable], sizes: Sequence[Optional[int]]) -> list[Optional["Borrowed"]]:
        """``borrow`` of a step's pages under one lock (a size of None is a miss)."""
        out: list[Optional[Borrowed]] = []
        with self._lock:
            for key, nbytes in zip(keys, sizes):
                entry = self._entries.get(key) if nbytes is not None else None
                if entry is None or entry.buf.numel() != nbytes:
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.readers += 1
                out.append(Borrowed(self, entry))
        return out

    def release_many(self, lent: Sequence["Borrowed"]) -> None:
        """``release()`` of each, under one lock (each ``Borrowed.release`` comes here too)."""
        entries = []
        for b in lent:
            if b._tier is not None:
                b._tier = None
                entries.append(b._entry)
        last = []
        with self._lock:
            for entry in entries:
                entry.readers -= 1
                if entry.gone and entry.readers == 0:
                    last.append(entry)
        for entry in last:
            self._memory.give(entry.buf, entry.slab)

    def _drop(self, entry: "_Entry") -> None:
        """``entry`` left the tier (under the lock): its buffer is reused once nobody reads it."""
        self._used -= entry.buf.numel()
        if entry.readers:
            entry.gone = True
        else:
            self._memory.give(entry.buf, entry.slab)

    # -- writes -----------------------------------------------------------------------------------
    def put(self, key: Hashable, segments: Sequence[torch.Tensor]) -> Put:
        """Hold a copy of a page's ``segments`` (host or device memory, read in order) as ``key``'s
        payload, evicting least recently used entries to make room. The caller guarantees the
        segments hold exactly ``key``'s verified payload and stay unchanged during the call. A key
        already held is only made the most recent; a page larger than the budget is not held."""
        nbytes = payload_nbytes(segments)
        if nbytes is None:
            raise ValueError("a page segment must be contiguous to be copied in place")
        slot = self.reserve(key, nbytes)
        if slot is None:
            return Put()
        try:
            gather(segments, slot.buf)
        except BaseException:
            self.abort(slot)
            raise
        return self.commit(slot)

    def reserve(self, key: Hashable, nbytes: int) -> Optional["Reserved"]:
        """A buffer of ``nbytes`` for ``key``'s payload, to be filled by the caller and then
        ``commit``-ted (or ``abort``-ed): None when the tier holds ``key`` already (it becomes the
        most recent entry), the page does not fit the budget, or no memory can be had. Room is
        made now (least recent entries evicted) and counted as used until the end. Called by
        ``put``; ``reserve_many`` is the same for a step's loads from the disk, so that each fills
        the buffer its page will be kept in as it fills the page (one pass over the payload, not a
        second one after the load)."""
        return self.reserve_many([key], [nbytes])[0]

    def reserve_many(self, keys: Sequence[Hashable], sizes: Sequence[Optional[int]],
                     saving: bool = False) -> list[Optional["Reserved"]]:
        """``reserve`` for a step's pages read from the disk at once (a size None or 0 gets
        None): room made and counted under one lock, buffers taken in one pass
        (``SlabPool.take_many``). Called by ``KvService.load_many``, and by ``save_many`` with
        ``saving=True``: a save takes free room, and evicts for room only while the saves in
        flight hold at most ``SAVE_EVICT_SHARE`` of the budget (a page that gets none is copied
        in when its save is done)."""
        out: list[Optional[Reserved]] = [None] * len(keys)
        want: list[tuple[int, Hashable, int, int, int]] = []
        may_evict = self.capacity * SAVE_EVICT_SHARE
        with self._lock:
            for i, (key, nbytes) in enumerate(zip(keys, sizes)):
                if key in self._entries:
                    self._entries.move_to_end(key)
                elif nbytes and 0 < nbytes <= self.capacity and (
                        not saving or self._used + nbytes <= self.capacity or self._saving + nbytes <= may_evict):
                    pages, freed = self._evict_until(self.capacity - nbytes)
                    self._used += nbytes
                    self._saving += nbytes if saving else 0
                    want.append((i, key, nbytes, pages, freed))
        if not want:
            return out
        try:
            got = self._memory.take_many([nbytes for _, _, nbytes, _, _ in want])
        except BaseException:
            with self._lock:
                self._used -= sum(nbytes for _, _, nbytes, _, _ in want)
                self._saving -= sum(nbytes for _, _, nbytes, _, _ in want) if saving else 0
            raise
        unused = 0
        for (i, key, nbytes, pages, freed), taken in zip(want, got):
            if taken is None:
                unused += nbytes
            else:
                out[i] = Reserved(key, taken[0], taken[1], pages, freed, saving)
        if unused:
            with self._lock:
                self._used -= unused
                self._saving -= unused if saving else 0
        return out

    def settle_many(self, commits: Sequence["Reserved"], aborts: Sequence["Reserved"]) -> list[Put]:
        """``commit`` each of ``commits`` and ``abort`` each of ``aborts`` under one lock (a
        slice of loads finished: ``KvService._loads_finished``); a ``Put`` each, the commits'
        then the aborts' (not taken, with what their reservation evicted all the same)."""
        puts: list[Put] = []
        back: list[Reserved] = list(aborts)
        with self._lock:
            for slot in commits:
                if slot.key not in self._entries:
                    self._entries[slot.key] = _Entry(slot.buf, slot.slab)
                    puts.append(Put(True, slot.evicted, slot.evicted_bytes))
                else:
                    self._entries.move_to_end(slot.key)
                    back.append(slot)
                    puts.append(Put(False, slot.evicted, slot.evicted_bytes))
            puts += [Put(False, slot.evicted, slot.evicted_bytes) for slot in aborts]
            self._used -= sum(slot.buf.numel() for slot in back)
            self._saving -= sum(slot.buf.numel() for slot in (*commits, *aborts) if slot.saving)
        if back:
            self._memory.give_many([(slot.buf, slot.slab) for slot in back])
        return puts

    def commit(self, slot: "Reserved") -> Put:
        """``slot``'s buffer, now holding exactly its key's verified payload, becomes the key's
        entry (unless another thread's entry for the key came first: then it is given back)."""
        return self.settle_many([slot], [])[0]

    def abort(self, slot: "Reserved") -> None:
        """``slot`` will not be committed (its load failed): its buffer and room are given back."""
        self.settle_many([], [slot])

    def discard(self, key: Hashable) -> bool:
        """Forget ``key``'s payload; whether it was held."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._drop(entry)
            return entry is not None

    def clear(self) -> None:
        """Forget every entry and spare buffer (``KvService.close``)."""
        with self._lock:
            self._entries.clear()
            self._memory.clear()
            self._used = self._saving = 0

    def _evict_until(self, limit: int) -> tuple[int, int]:
        """Drop least recent entries until ``used <= limit``; under the lock."""
        pages = freed = 0
        while self._used > limit and self._entries:
            _, entry = self._entries.popitem(last=False)
            pages += 1
            freed += entry.buf.numel()
            self._drop(entry)
        return pages, freed


class Reserved(NamedTuple):
    """A buffer ``HostTier.reserve`` set aside for ``key``'s payload; ``evicted`` pages of
    ``evicted_bytes`` left the tier to make room for it. (A tuple: one per page read.)"""

    key: Hashable
    buf: torch.Tensor
    slab: Any
    evicted: int
    evicted_bytes: int
    saving: bool = False
    """Reserved by a save (counted against ``SAVE_EVICT_SHARE`` until settled)."""


class Borrowed:
    """A payload lent out by ``HostTier.borrow``: ``buf``, until ``release()`` (idempotent)."""

    __slots__ = ("buf", "_tier", "_entry")

    def __init__(self, tier: HostTier, entry: _Entry) -> None:
        self.buf = entry.buf
        self._tier: Optional[HostTier] = tier
        self._entry = entry

    def release(self) -> None:
        if self._tier is not None:
            self._tier.release_many([self])

    def __enter__(self) -> torch.Tensor:
        return self.buf

    def __exit__(self, *exc: Any) -> None:
        self.release()


def keeps_page_cache_reads(segments: Sequence[torch.Tensor]) -> bool:
    """Whether a load into these segments should fill the tier when the page cache served its
    chunk. Not for pages in host memory: the kernel already keeps those bytes in host memory,
    where a load copies them as fast as from the tier, so a second copy would only cost the load
    another pass and halve what the machine keeps warm. Device pages are: the tier's pinned
    buffers reach a device directly. Asked by ``KvService.load_many`` for each page it reads."""
    for s in segments:
        if not s.is_cpu:
            return True
    return False
