"""Device ordering between an engine's streams and gdskv's transfer threads; zero-copy page views.

A transfer thread touches a page slot only once the engine's kernels are done with it: the engine
hands a slot over (TensorRT-LLM's ``start_load_kv(stream)`` / ``save_kv_layer(layer, stream)``,
MAX's ``load`` / ``offload``) while kernels it queued earlier may still read or write that slot.
The connector records a *readiness* on the engine's stream at that moment and passes it as
``ready=`` to ``PageTransfer.save_page`` / ``load_page``, whose thread calls
``ready.synchronize()`` before its first byte of I/O on the page. The other direction (the engine
reading what a load wrote) is host-ordered: a load's future resolves once its bytes are in the
slot, and the engine launches the kernels that read them only after it saw that.

The connectors call the functions below and never ``torch.cuda`` directly, so the ordering is
testable without a GPU: ``use(ordering)`` swaps in another ``Ordering`` (the tests' records every
step, with events a test releases late). The default, ``CudaOrdering``, uses blocking CUDA events
(``blocking=True``: a waiting transfer thread sleeps instead of spinning a core); for host memory
and for an engine that passes no stream (the reference engine, whose compute is synchronous)
there is nothing to wait for and the readiness is ``None``.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, Protocol

import torch

log = logging.getLogger(__name__)


class Readiness(Protocol):
    """Something a transfer thread waits on before it touches a page (a CUDA event)."""

    def synchronize(self) -> None: ...


class AllReady:
    """Several readinesses as one (pages of one transfer on several devices)."""

    def __init__(self, parts: Sequence[Readiness]) -> None:
        self.parts = tuple(parts)

    def synchronize(self) -> None:
        for p in self.parts:
            p.synchronize()


class CudaOrdering:
    """The real ordering: blocking CUDA events on the engine's streams."""

    def stream_of(self, device: Any) -> Optional[Any]:
        """The stream the engine works on for ``device`` when it named none: the current stream
        of a CUDA device; None for host memory."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return torch.cuda.current_stream(device)

    def record(self, stream: Any) -> Optional[Readiness]:
        """A blocking event recorded on ``stream`` now; None when ``stream`` is not a CUDA stream."""
        if not isinstance(stream, torch.cuda.Stream):
            return None
        event = torch.cuda.Event(enable_timing=False, blocking=True)
        event.record(stream)
        return event

    def snapshot(self, segments: Sequence[torch.Tensor], stream: Any) -> tuple[list[torch.Tensor], Optional[Readiness]]:
        """Copies of ``segments`` taken in ``stream``'s order (after the kernels queued on it so
        far, before any queued later), and the readiness of those copies. Device pages are
        copied into pinned host memory on ``stream``; host pages (and pages of an engine that
        passed no stream) are cloned here, at once."""
        if not isinstance(stream, torch.cuda.Stream) or not all(s.is_cuda for s in segments):
            return [s.clone() for s in segments], None
        with torch.cuda.stream(stream):
            copies = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in segments]
            for c, s in zip(copies, segments):
                c.copy_(s, non_blocking=True)
        return copies, self.record(stream)

    def copy_into(self, pages: Sequence[torch.Tensor], src: torch.Tensor) -> None:
        """Copy ``src`` into every page and return once the bytes have landed (the copies run on
        the calling thread's current stream; the wait is a blocking event, not a spin)."""
        for p in pages:
            p.copy_(src)
        for device in {p.device for p in pages if p.is_cuda}:
            ready = self.record(torch.cuda.current_stream(device))
            if ready is not None:
                ready.synchronize()


_ordering: Any = CudaOrdering()


@contextlib.contextmanager
def use(o: Any) -> Iterator[Any]:
    """Use ``o`` (same methods as ``CudaOrdering``) in place of the CUDA ordering. Tests only."""
    global _ordering
    before, _ordering = _ordering, o
    try:
        yield o
    finally:
        _ordering = before


def record_ready(stream: Any = None, devices: Iterable[Any] = (), streams: Optional[Mapping[Any, Any]] = None) -> Optional[Readiness]:
    """The readiness of the engine's work queued so far: recorded on ``stream`` when the engine
    handed one, else on the engine's stream of each of ``devices`` (``streams[device]`` when
    given, else the device's current stream). None when there is nothing to wait for.

    Called by the connectors at the moment the engine hands page slots over."""
    o = _ordering
    if stream is not None:
        return o.record(stream)
    parts = []
    for device in dict.fromkeys(devices):
        s = (streams or {}).get(device)
        ready = o.record(s if s is not None else o.stream_of(device))
        if ready is not None:
            parts.append(ready)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllReady(parts)


def snapshot(segments: Sequence[torch.Tensor], stream: Any = None, device: Any = None) -> tuple[list[torch.Tensor], Optional[Readiness]]:
    """Copies of a page's segments in the engine's stream order, and their readiness; see
    ``CudaOrdering.snapshot``. For a page the engine may reuse before a save of it has finished
    reading (a sliding-window page the cache reclaims once the window moves)."""
    o = _ordering
    if stream is None and device is not None:
        stream = o.stream_of(device)
    return o.snapshot(list(segments), stream)


def copy_into(pages: Sequence[torch.Tensor], src: torch.Tensor) -> None:
    """Copy ``src`` into each of ``pages``; returns once the bytes are there (device copies too)."""
    _ordering.copy_into(list(pages), src)


def engine_streams(devices: Iterable[Any]) -> dict[torch.device, Any]:
    """``{torch device: stream}`` of MAX devices whose default stream exposes a native handle
    (``max.driver.Device.default_stream.native_stream_handle``), as ``torch.cuda.ExternalStream``.
    Host devices and devices without a handle are left out (their pages are ordered on the
    device's current stream)."""
    out: dict[torch.device, Any] = {}
    for dev in devices:
        if getattr(dev, "is_host", False) or getattr(dev, "label", "gpu") == "cpu":
            continue
        handle = getattr(getattr(dev, "default_stream", None), "native_stream_handle", 0)
        if not handle:
            log.info("gdskv: device %s exposes no native stream handle; ordering on torch's current stream", dev)
            continue
        device = torch.device("cuda", int(getattr(dev, "id", 0)))
        out[device] = torch.cuda.ExternalStream(int(handle), device=device)
    return out


def zero_copy_view(buffer: Any, what: str) -> torch.Tensor:
    """A torch tensor over ``buffer``'s own memory, or ``ValueError`` naming ``what`` and why.

    DLPack first. Only a host buffer may go through ``to_numpy()``, and only when that is itself
    a view (two calls share memory): a device buffer seen through a host copy would have loads
    never reach the device and offloads save a stale snapshot."""
    if isinstance(buffer, torch.Tensor):
        return buffer
    try:
        return torch.from_dlpack(buffer)
    except Exception as e:  # no DLPack export, or one torch cannot take
        why = f"torch.from_dlpack failed: {type(e).__name__}: {e}"
    device = getattr(buffer, "device", None)
    host = getattr(device, "is_host", None)
    if host is None and device is not None:
        host = str(getattr(device, "label", device)).split(":")[0] == "cpu"
    if host is False:
        raise ValueError(f"{what}: a device buffer (on {device}) cannot be viewed zero-copy ({why}); "
                         "gdskv refuses to work on a host copy of device KV")
    to_numpy = getattr(buffer, "to_numpy", None)
    if to_numpy is None:
        raise ValueError(f"{what}: the buffer cannot be viewed zero-copy ({why}) and has no to_numpy()")
    import numpy as np

    first, second = to_numpy(), to_numpy()
    if not np.shares_memory(first, second):
        raise ValueError(f"{what}: the buffer cannot be viewed zero-copy ({why}) and its to_numpy() returns "
                         "a copy, not a view of its memory; gdskv refuses to work on a copy")
    return torch.from_numpy(first)
