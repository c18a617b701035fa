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
which fill each entry's buffer as they fill the page); ``gather``/``scatter`` are the copies
between an entry and a page's segments.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import torch

from gdskv.hostmem import SlabPool
from gdskv.io import batch as batchio
from gdskv.io import capabilities

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


def payload_nbytes(segments: Sequence[torch.Tensor]) -> Optional[int]:
    """Bytes of a page's segments, or None when one is not contiguous (it cannot be copied in
    place: the tier neither takes nor serves it)."""
    n = 0
    for s in segments:  # a loop, not all() and sum() over generators: called for every page posted
        if not s.is_contiguous():
            return None
        n += s.nbytes
    return n


def _flat(segment: torch.Tensor) -> torch.Tensor:
    """A page segment as a flat byte view of its own memory (never a copy)."""
    if not segment.is_contiguous():
        raise ValueError("a page segment must be contiguous to be copied in place")
    return segment.reshape(-1).view(torch.uint8)


def gather(segments: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``segments`` one after another into the flat host buffer ``out``; returns once every
    byte is there (device copies included). ``ValueError`` when the sizes do not add up."""
    _move(out, segments, into_segments=False)


def scatter(src: torch.Tensor, segments: Sequence[torch.Tensor]) -> None:
    """Copy the flat host buffer ``src`` into ``segments`` one after another; returns once every
    byte is there (device copies included). ``ValueError`` when the sizes do not add up."""
    _move(src, segments, into_segments=True)


def scatter_many(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], threads: int,
                 checked: bool = False) -> None:
    """``scatter`` of several entries into plain host memory in one native call on ``threads``
    threads without the GIL (``gdskv.io.batch.copy_many``), or one by one where the extension is
    not built. ``ValueError`` when a page's sizes do not add up or a segment is not contiguous
    host memory (nothing copied then). ``checked``: the caller has made sure of all that already
    (``KvService`` for the host-tier hits it serves: CPU segments, ``payload_nbytes`` of them equal
    to the entry's size), so no page is looked at twice."""
    if not batchio.available():
        for buf, segments in pairs:
            scatter(buf, segments)
        return
    if not checked:
        for buf, segments in pairs:
            if not all(s.device.type == "cpu" and s.is_contiguous() for s in segments):
                raise ValueError("scatter_many copies into contiguous host memory only")
            total = sum(s.nbytes for s in segments)
            if total != buf.numel():
                raise ValueError(f"page segments of {total} bytes for a buffer of {buf.numel()}")
    batchio.copy_many(scatter_copies(pairs), threads)


def scatter_copies(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> list[tuple[int, int, int]]:
    """The host-memory copies ``(dst, src, length)`` that scatter each flat buffer into its page's
    segments (contiguous host memory adding up to the buffer: the caller made sure), for
    ``copy_many`` (``scatter_many``) or ``copy_later`` (``KvService``'s asynchronous hits)."""
    copies = []
    for buf, segments in pairs:
        src = buf.data_ptr()
        for s in segments:
            n = s.nbytes
            copies.append((s.data_ptr(), src, n))
            src += n
    return copies


def gather_all(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> None:
    """``gather`` of several pages into their flat host buffers, wherever the pages are: host
    pages copied at once, the device copies all queued before one wait per device. Returns once
    every byte is in place. Called on a transfer thread before a staged slice's native writes
    (``PageTransfer._through_staging``)."""
    queued: list[torch.Tensor] = []
    device: list[tuple[torch.Tensor, Sequence[torch.Tensor]]] = []
    try:
        for buf, segments in pairs:
            if all(s.device.type == "cpu" for s in segments):
                gather(segments, buf)
            else:
                device.append((buf, segments))
        _queue_all(device, False, queued)
    finally:
        _wait_for_devices(queued)


def scatter_all(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], threads: int) -> None:
    """``scatter`` of several entries, wherever their pages are: those in plain host memory in one
    ``scatter_many``, the others' copies all queued before one wait per device (not one per page).
    Returns once every byte is in place. Called on a copy thread (``KvService._hits_after``)."""
    host: list[tuple[torch.Tensor, Sequence[torch.Tensor]]] = []
    device: list[tuple[torch.Tensor, Sequence[torch.Tensor]]] = []
    for pair in pairs:
        (host if all(s.device.type == "cpu" for s in pair[1]) else device).append(pair)
    if host:
        scatter_many(host, threads)
    queued: list[torch.Tensor] = []
    try:
        _queue_all(device, True, queued)
    finally:  # the buffers go back after this: no copy may still read them
        _wait_for_devices(queued)


def _move(buf: torch.Tensor, segments: Sequence[torch.Tensor], into_segments: bool) -> None:
    sizes = [s.numel() * s.element_size() for s in segments]
    if not all(s.is_contiguous() for s in segments):
        raise ValueError("a page segment must be contiguous to be copied in place")
    if sum(sizes) != buf.numel():
        raise ValueError(f"page segments of {sum(sizes)} bytes for a buffer of {buf.numel()}")
    if all(s.device.type == "cpu" for s in segments):
        # one memcpy per segment, GIL released, no tensor made: torch's copy_ would split it over
        # its intra-op threads (100x slower on a busy host) and each slice costs microseconds
        off = buf.data_ptr()
        for s, n in zip(segments, sizes):
            if into_segments:
                ctypes.memmove(s.data_ptr(), off, n)
            else:
                ctypes.memmove(off, s.data_ptr(), n)
            off += n
        return
    _wait_for_devices(_queue(buf, segments, into_segments))


NATIVE_DEVICE_COPIES = True
"""Whether ``_queue_all`` queues device copies in one native call per device;
``scripts/gpu_check.py`` turns it off for its comparison."""


def _queue_all(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], into_segments: bool,
               queued: list[torch.Tensor]) -> None:
    """Queue the copies between each pair's flat host buffer and its device segments on this
    thread's current streams, adding to ``queued`` what ``_wait_for_devices`` waits on (before
    anything is queued, so a failure part way still waits for what was). Where the CUDA runtime's
    ``cudaMemcpyAsync`` is found, one native call per device queues them all
    (``batchio.copy_device``): a torch copy per segment, queued from Python, hands the GIL to
    the other transfer threads and back each time, which held warm 256 KiB loads into CUDA pages
    to a third of the pinned pool's pace (3.7 against 10.4 GB/s on an H200 host). Else, or with
    any segment not on a CUDA device, one torch copy per segment (``_queue``). ``ValueError``
    when a segment is not contiguous or the sizes do not add up (nothing queued then);
    ``RuntimeError`` when the runtime refuses a copy."""
    fn = capabilities.cuda_memcpy_async() if NATIVE_DEVICE_COPIES and pairs and batchio.available() else 0
    by_device = device_copies(pairs, into_segments) if fn else {}
    if not fn or any(d.type != "cuda" for d in by_device):
        for buf, segments in pairs:
            queued += _queue(buf, segments, into_segments)
        return
    queued += [segments[0] for _, segments in pairs]
    for device, copies in by_device.items():
        with torch.cuda.device(device):
            err = batchio.copy_device(copies, fn, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync refused a page copy on {device}: CUDA error {err}")


def device_copies(pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]],
                  into_segments: bool) -> dict[torch.device, list[tuple[int, int, int]]]:
    """The copies ``(dst, src, length)`` between each pair's flat host buffer and its segments
    (end to end in the buffer, as ``scatter``/``gather`` lay them), grouped by the segments'
    device. ``ValueError`` when a segment is not contiguous or the sizes do not add up. Called by
    ``_queue_all``."""
    out: dict[torch.device, list[tuple[int, int, int]]] = {}
    for buf, segments in pairs:
        at = start = buf.data_ptr()
        for s in segments:
            if not s.is_contiguous():
                raise ValueError("a page segment must be contiguous to be copied in place")
            n = s.nbytes
            out.setdefault(s.device, []).append((s.data_ptr(), at, n) if into_segments else (at, s.data_ptr(), n))
            at += n
        if at - start != buf.nbytes:
            raise ValueError(f"page segments of {at - start} bytes for a buffer of {buf.nbytes}")
    return out


def _queue(buf: torch.Tensor, segments: Sequence[torch.Tensor], into_segments: bool) -> list[torch.Tensor]:
    """The copies between ``buf`` and ``segments`` queued on this thread's current streams (device
    copies do not wait); the flat views copied, for ``_wait_for_devices``. ``ValueError`` when the
    sizes do not add up or a segment is not contiguous (nothing queued then)."""
    parts = [_flat(s) for s in segments]
    total = sum(p.numel() for p in parts)
    if total != buf.numel():
        raise ValueError(f"page segments of {total} bytes for a buffer of {buf.numel()}")
    off = 0
    for p in parts:
        piece = buf[off:off + p.numel()]
        if into_segments:
            p.copy_(piece, non_blocking=p.is_cuda)
        else:
            piece.copy_(p, non_blocking=p.is_cuda)
        off += p.numel()
    return parts


def _wait_for_devices(parts: Sequence[Any]) -> None:
    """Block (sleeping on an event, not spinning) until the copies queued on this thread's current
    stream of each device involved have finished."""
    for device in {p.device for p in parts if p.is_cuda}:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
