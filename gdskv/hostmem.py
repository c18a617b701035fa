"""Host buffers for the host tier, carved from large slabs: ``SlabPool``.

A tier that allocates page by page makes one allocation per page (one ``cudaHostAlloc`` per
page where CUDA is present, milliseconds each) and, as it only kept the buffers of one eviction
for reuse, kept going back to the allocator. Slabs are ``SLAB_BYTES`` each (one page-locked
allocation where CUDA is present, plain host memory elsewhere); buffers given back are reused and
never returned to the allocator until ``clear``, so a warm tier allocates nothing.

Slabs are not advised to use transparent huge pages: on the dev VM the first 512 MiB of them
cost 0.6-1.0 s of kernel time in compaction (then 0.02 s once huge pages were free), against a
steady 0.19 s of 4 KiB page faults, and that kernel time is taken from the serving loop's CPU.

Called by ``gdskv.hosttier.HostTier`` (``take`` in ``put``, ``give`` when an entry nobody reads
any more leaves the tier).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

log = logging.getLogger(__name__)

SLAB_BYTES = 32 << 20
"""Bytes of one slab (or one buffer, for pages larger than that)."""


@dataclass
class _Slab:
    memory: Any
    nbytes: int
    unused: list[torch.Tensor] = field(default_factory=list)
    lent: int = 0


class SlabPool:
    """Buffers of exact sizes for a tier of ``capacity`` bytes: at most one slab more than that
    is held (``limit``). Thread-safe.

    ``take(n)`` gives a flat ``uint8`` tensor of ``n`` bytes and its slab, or None when no slab
    has one unused and another would cross ``limit`` even after releasing every slab that lends
    nothing (the caller then does without). ``pinned``: page-locked slabs (falls back to plain
    memory, logged once, when pinning fails).
    """

    def __init__(self, capacity: int, pinned: bool) -> None:
        self.slab_bytes = max(1, min(SLAB_BYTES, capacity))
        self.limit = capacity + self.slab_bytes
        self.pinned = pinned
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._allocating = False
        """A slab is being allocated: ``take`` waits for it rather than allocate beside it (threads
        filling an empty tier at once would each allocate a slab, and the limit refuse the rest)."""
        self._slabs: list[_Slab] = []
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of slabs held."""
        with self._lock:
            return self._bytes

    def _take_unused(self, nbytes: int) -> Optional[tuple[torch.Tensor, _Slab]]:
        """A held slab's unused buffer of ``nbytes``, or None; under the lock."""
        out: list[Optional[tuple[torch.Tensor, _Slab]]] = [None]
        self._take_unused_run(nbytes, [0], out)
        return out[0]

    def _take_unused_run(self, nbytes: int, at: list[int], out: list) -> None:
        """Held slabs' unused buffers of ``nbytes`` into ``out[k]`` for each ``k`` of ``at``, as
        far as they go, the first slab's last unused buffer first; under the lock."""
        done = 0
        for slab in self._slabs:
            if done == len(at):
                return
            unused = slab.unused
            if not unused or unused[-1].numel() != nbytes:  # a slab's buffers are all of one size
                continue
            n = min(len(unused), len(at) - done)
            run = unused[-n:]
            del unused[-n:]
            slab.lent += n
            for k, buf in zip(at[done:done + n], reversed(run)):
                out[k] = (buf, slab)
            done += n

    def take_many(self, sizes: Sequence[int]) -> list[Optional[tuple[torch.Tensor, _Slab]]]:
        """``take`` for each size: what held slabs have, under one lock, taken a slab's run at a
        time (a step's pages are all of one size); the rest one by one (a slab may have to be
        allocated)."""
        out: list[Optional[tuple[torch.Tensor, _Slab]]] = [None] * len(sizes)
        wanted: dict[int, list[int]] = {}
        for k, nbytes in enumerate(sizes):
            wanted.setdefault(nbytes, []).append(k)
        with self._lock:
            for nbytes, at in wanted.items():
                self._take_unused_run(nbytes, at, out)
        for k, got in enumerate(out):
            if got is None:
                out[k] = self.take(sizes[k])
        return out

    def take(self, nbytes: int) -> Optional[tuple[torch.Tensor, _Slab]]:
        """A buffer of ``nbytes`` and its slab: an unused one of that size, else from a new
        slab (idle slabs freed first to stay within ``limit``); None when the limit leaves no
        room. Waits while another thread allocates a slab. Called by ``take_many``."""
        with self._cond:
            while True:
                got = self._take_unused(nbytes)
                if got is not None:
                    return got
                if not self._allocating:
                    break
                self._cond.wait()  # the slab being allocated may have a buffer of this size
            size = max(nbytes, self.slab_bytes // nbytes * nbytes)
            if self._bytes + size > self.limit:
                idle = [s for s in self._slabs if s.lent == 0]
                self._slabs = [s for s in self._slabs if s.lent]
                self._bytes -= sum(s.nbytes for s in idle)
                if self._bytes + size > self.limit:
                    return None
            self._bytes += size
            self._allocating = True
        slab: Optional[_Slab] = None
        try:  # outside the lock (a page-locked allocation takes milliseconds): givers need not wait
            memory = self._allocate(size)
            slab = _Slab(memory, size, [memory[i:i + nbytes] for i in range(nbytes, size - nbytes + 1, nbytes)][::-1], 1)
        finally:
            with self._cond:
                self._allocating = False
                if slab is None:
                    self._bytes -= size
                else:
                    self._slabs.append(slab)
                self._cond.notify_all()
        return memory[:nbytes], slab

    def give(self, buf: torch.Tensor, slab: _Slab) -> None:
        """``buf`` (from ``take``) is unused again."""
        self.give_many([(buf, slab)])

    def give_many(self, bufs: Sequence[tuple[torch.Tensor, _Slab]]) -> None:
        """``give`` for each ``(buf, slab)``, under one lock."""
        with self._lock:
            for buf, slab in bufs:
                slab.lent -= 1
                slab.unused.append(buf)

    def clear(self) -> None:
        """Forget every slab (buffers still lent stay valid for their holders)."""
        with self._lock:
            self._slabs, self._bytes = [], 0

    def _allocate(self, size: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                log.warning("gdskv: host tier cannot pin memory (%s); using pageable host memory", e)
                self.pinned = False
        return torch.empty(size, dtype=torch.uint8)
