"""What the transfer layer hands back and takes: page statuses, ``LoadVia``, a page's segments.

Imported by every part of ``gdskv.transfer`` and, through the package, by the service, the
connector workers, the demo and the benchmarks.
"""
from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence

import torch

from gdskv.io.base import Buffer, Segment, tensor_bytes

DoneFn = Callable[[list[int], Optional[list[Any]], list[int]], None]
"""``on_done(done, results, skipped)`` of ``save_pages``/``load_pages``: see ``PageTransfer._batch``."""


class SaveStatus(enum.Enum):
    """How a save ended: the chunk published, already stored, or dropped (budget, disk full,
    an error: the page is simply not cached)."""

    PUBLISHED = "published"
    EXISTS = "exists"
    DROPPED = "dropped"


class LoadStatus(enum.Enum):
    """How a load ended: the page holds the stored KV, or it does not (no chunk, or one that
    failed verification and was quarantined) and must be computed."""

    LOADED = "loaded"
    MISSING = "missing"
    CORRUPT = "corrupt"


class LoadVia:
    """A load's second destination (``load_pages``): ``buf``, a flat ``uint8`` host buffer of the
    page's size (the host tier's, ``KvService.load_many``), gets the payload too. ``cached``:
    also when the page cache serves the chunk; when False, the native path leaves ``buf`` alone
    for such a chunk. ``copied`` is set before the batch's ``on_done`` runs: whether ``buf``
    holds the payload of a LOADED page."""

    __slots__ = ("buf", "cached", "copied")

    def __init__(self, buf: torch.Tensor, cached: bool = True) -> None:
        self.buf = buf
        self.cached = cached
        self.copied = False


def page_segments(group_layout: Any, slot: int) -> list[torch.Tensor]:
    """The byte tensors of page slot ``slot`` of a layer group, region by region.

    ``slot_tensor`` raises ``IndexError`` outside the pool, so ``-1`` can never alias a page.
    """
    return [r.slot_tensor(slot) for r in group_layout.regions]


def as_list(segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A page's segments as the list its job holds: a list is taken as it is (its caller keeps it
    unchanged until the page's future resolves, as it keeps the page's memory; ``KvService``
    hands over lists of its own), so a page posted costs no second list."""
    return segments if type(segments) is list else list(segments)


def file_segments(pages: Sequence[torch.Tensor], trailer: Buffer) -> list[Segment]:
    """A chunk's engine segments: the page's regions end to end, then the trailer. Host regions
    go to the engine as byte views (made once here: each torch view op costs microseconds, and
    the engine would otherwise make several per region), device regions as tensors."""
    segs, off = [], 0
    for t in pages:
        nbytes = t.numel() * t.element_size()
        segs.append(Segment(off, memoryview(tensor_bytes(t).numpy()) if t.device.type == "cpu" else t))
        off += nbytes
    segs.append(Segment(off, trailer))
    return segs

