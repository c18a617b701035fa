"""Host staging for a slice of pages on the native batch path (``PageTransfer``).

Where the engine has no GPUDirect Storage, a page in device memory reaches the disk through host
memory anyway. One page at a time (a blocking copy per region on a Python thread, then the
per-page file path) that held 256 KiB loads into CUDA pools at 0.4x the disk on an H200 machine.
``SliceStaging`` lets a whole slice go the native way instead: its pages are laid out in one host
buffer (pinned where CUDA is present, page-aligned either way, so O_DIRECT moves it in place),
the copies to or from the devices are all queued before one wait per device, and the native
batch moves the buffer's bytes. Measured there afterwards: 0.79x the disk.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence

import torch

from gdskv.io.posix import staging_buffer

STAGE_BYTES = 32 << 20
"""Most bytes staged at once per span (a slice of larger pages goes in several spans): a few
requests per native thread, without pinning a slice's worth of 4 MiB pages per span."""
ALIGN = 4096
Carved = Optional[tuple[torch.Tensor, list[torch.Tensor]]]
"""A page's share of a span's buffer: its flat view and its per-region views (None: not staged)."""


class SliceStaging:
    """Host buffers lent to one span of a slice at a time, carved into its pages: as many buffers
    as spans ever moved at once (not one per transfer thread: a pool's threads take turns).
    Made by ``PageTransfer``; ``spans`` and ``carved`` are called by its slice functions, on the
    transfer threads."""

    def __init__(self, limit: int = STAGE_BYTES):
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def spans(self, sizes: Sequence[int]) -> list[range]:
        """Consecutive runs of pages (by index into ``sizes``: the bytes to stage per page, 0 for
        a page that is not staged) whose staged bytes fit ``limit``; one page at least per run."""
        out, start, used = [], 0, 0
        for i, n in enumerate(sizes):
            need = _aligned(n)
            if used and used + need > self.limit:
                out.append(range(start, i))
                start, used = i, 0
            used += need
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out

    @contextlib.contextmanager
    def carved(self, pages: Sequence[Optional[Sequence[torch.Tensor]]]) -> Iterator[list[Carved]]:
        """For each page to stage (None for one that is not), a flat ``uint8`` view of a lent
        buffer as long as the page, and its per-region views (same sizes, end to end: what the
        chunk holds and its checksum covers), each page starting on a 4 KiB boundary; the
        buffer goes back when the block ends, and the views must not be used after it."""
        sizes = [None if p is None else [t.numel() * t.element_size() for t in p] for p in pages]
        total = sum(_aligned(sum(s)) for s in sizes if s is not None)
        if all(s is None for s in sizes):  # nothing to stage in this span: no buffer lent
            yield [None] * len(sizes)
            return
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < total:
            buf = staging_buffer(max(total, ALIGN, min(self.limit, 2 * total)))
        try:
            yield _carve(buf, sizes)
        finally:
            with self._lock:
                self._free.append(buf)


def _carve(buf: torch.Tensor, sizes: Sequence[Optional[Sequence[int]]]) -> list[Carved]:
    out: list[Carved] = []
    off = 0
    for s in sizes:
        if s is None:
            out.append(None)
            continue
        flat = buf[off:off + sum(s)]
        out.append((flat, region_views(flat, s)))
        off += _aligned(sum(s))
    return out


def region_views(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``flat`` of ``sizes`` bytes each, end to end from its start: a staged page's
    regions as its chunk holds them. Called by ``_carve`` and ``PageTransfer._staged``."""
    views, at = [], 0
    for n in sizes:
        views.append(flat[at:at + n])
        at += n
    return views


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
