"""Copies between a page's segments and one flat host buffer, wherever the segments are.

A page may lie in several segments (one per layer, or per K and V) in host or device memory; its
chunk, a host-tier entry and a staging buffer hold it end to end. ``gather`` copies the segments
into such a buffer, ``scatter`` back; ``gather_all``/``scatter_all`` do it for a step's pages at
once (host pages in one native call without the GIL, device pages queued on the current streams
with one wait per device).

Called by ``gdskv.transfer`` (a staged slice's pages, a via buffer), ``gdskv.hosttier`` (an entry
put) and ``gdskv.service`` (the host tier's hits).
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import torch

from gdskv.io import batch as batchio
from gdskv.io import capabilities


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
