"""The I/O engine interface: move bytes between memory (host or device) and files, asynchronously.

An engine knows nothing about chunks, keys or checksums; the store's transfer layer
(``gdskv.transfer``) builds chunk files out of these calls. Every call returns a
``concurrent.futures.Future`` that resolves to the number of bytes moved, or raises ``OSError``
(a short read is ``ShortReadError``).

A ``Segment`` is one contiguous memory range and its place in the file. Memory is a contiguous
tensor of any dtype on any device (a page slot from ``region.slot_tensor``, which the transfer
layer passes as ``uint8``), or any host buffer-protocol object (a chunk trailer). Segments of one call all belong to one file, so an
engine opens that file once per call.
"""
from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

Buffer = Union[torch.Tensor, bytes, bytearray, memoryview]


class ShortReadError(OSError):
    """The file ended before every requested byte was read (a truncated chunk)."""


@dataclass(frozen=True)
class Segment:
    """One memory range and its file offset; the transfer layer makes one per region of a page
    and one for the trailer behind them."""

    file_offset: int
    buf: Buffer

    @property
    def nbytes(self) -> int:
        if isinstance(self.buf, torch.Tensor):
            return self.buf.numel() * self.buf.element_size()
        return memoryview(self.buf).nbytes


class IoEngine(abc.ABC):
    """Asynchronous file I/O into and out of page memory.

    Created once per worker by ``gdskv.io.make_engine`` from the config; shared by all of the
    worker's transfers; ``close()`` at shutdown waits for in-flight calls.
    """

    name: str = "abstract"

    @property
    def gds_active(self) -> bool:
        """True when device memory moves to and from the file without a host bounce (GDS)."""
        return False

    @abc.abstractmethod
    def read(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        """Read each segment's bytes from ``path`` at its offset into its memory."""

    @abc.abstractmethod
    def write(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        """Create (or truncate) ``path`` and write each segment at its offset.

        The file is complete when the future resolves; durability beyond the page cache follows
        the engine's ``fsync`` setting.
        """

    def read_now(self, path: str, segments: Sequence[Segment]) -> int:
        """``read`` on the calling thread. The transfer layer's threads call this once per page,
        so a page costs no hand-off to a second thread; both engines override this fallback
        (``read(...).result()``) with their own synchronous call."""
        return self.read(path, segments).result()

    def write_now(self, path: str, segments: Sequence[Segment]) -> int:
        """``write`` on the calling thread (see ``read_now``)."""
        return self.write(path, segments).result()

    def read_batch(self, ops: Sequence[tuple[str, Sequence[Segment]]]) -> list["Future[int]"]:
        """``read`` of several files at once. The transfer layer does not use it (it calls
        ``read_now`` per page on its own threads); tests and tools may."""
        return [self.read(path, segs) for path, segs in ops]

    def write_batch(self, ops: Sequence[tuple[str, Sequence[Segment]]]) -> list["Future[int]"]:
        """``write`` of several files at once (see ``read_batch``)."""
        return [self.write(path, segs) for path, segs in ops]

    @property
    def batches_chunks(self) -> bool:
        """Whether ``read_chunks_now``/``write_chunks_now`` can move a slice of host pages in one
        native call (``gdskv.io.batch``); the transfer layer asks before each batch."""
        return False

    def read_chunks_now(self, root_fd: int, jobs: Sequence[tuple], threads: int = 1) -> list:
        """Read and checksum whole chunk files beneath ``root_fd`` into host memory before
        returning, ``threads`` of them at a time: one ``gdskv.io.batch.ReadResult`` per job
        (``(rel, pieces)`` or ``(rel, pieces, outs)``: see ``gdskv.io.batch.read_chunks``).
        Called by the transfer layer's threads with a slice of a step's pages, only where
        ``batches_chunks``."""
        raise NotImplementedError

    def read_chunks_later(self, completions: Any, root_fd: int, jobs: Sequence[tuple], threads: int, nice: int,
                          tag: Any) -> None:
        """``read_chunks_now`` started on ``threads`` native threads niced by ``nice`` and
        returning at once; ``collect_done(completions)`` hands back ``(tag, results)`` once it
        finished. Called by the transfer layer for asynchronous loads, only where
        ``batches_chunks``."""
        raise NotImplementedError

    def write_chunks_later(self, completions: Any, root_fd: int, jobs: Sequence[tuple], threads: int,
                           dir_mode: Optional[int], nice: int, tag: Any) -> None:
        """``write_chunks_now`` started as ``read_chunks_later`` starts reads; a job may ask to be
        sealed natively (``gdskv.io.batch.write_later``)."""
        raise NotImplementedError

    def copy_later(self, completions: Any, copies: Sequence[tuple[int, int, int]], threads: int, nice: int,
                   tag: Any) -> None:
        """Host-memory copies ``(dst, src, length)`` started as ``read_chunks_later`` starts
        reads (None for results). Called by the transfer layer for host-tier hits of
        asynchronous loads, only where ``batches_chunks``."""
        raise NotImplementedError

    def collect_done(self, completions: Any) -> list[tuple[Any, Optional[list]]]:
        """``(tag, results)`` of each ``read_chunks_later``/``write_chunks_later``/``copy_later``
        on ``completions`` finished since the last call, without waiting."""
        raise NotImplementedError

    def write_chunks_now(self, root_fd: int, jobs: Sequence[tuple[str, str, str, Sequence[tuple[int, int]]]],
                         threads: int = 1, dir_mode: Optional[int] = None) -> list[int]:
        """Write and publish whole chunk files beneath ``root_fd`` from host memory before
        returning: an errno per job, 0 when published (see ``read_chunks_now``). ``dir_mode``:
        a chunk's missing directory is made (with its parents) with this mode; None: that job
        fails with ``ENOENT``."""
        raise NotImplementedError

    def register_buffers(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register a worker's page memory (its KV pool regions) with the engine once, at
        bring-up, where that makes device transfers faster (cuFile buffer registration under
        GDS); how many allocations were registered. A no-op (0) here and in the POSIX engine."""
        return 0

    def close(self) -> None:
        """Wait for in-flight calls and release threads and handles."""

    def describe(self) -> str:
        """One line for bring-up logs (connectors, ``gdskv info``, the demo): name and GDS state."""
        return f"{self.name} (GDS {'active' if self.gds_active else 'inactive'})"


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's memory as a flat ``uint8`` tensor on its own device: a view, never a copy
    (a non-contiguous tensor is the caller's error, ``ValueError``: reading into a copy would
    lose the bytes). Called by both engines for every tensor segment."""
    if not t.is_contiguous():
        raise ValueError("segment memory must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


def host_view(buf: Buffer) -> memoryview:
    """A zero-copy byte view of host memory (a CPU tensor, bytearray, bytes, ...); the POSIX
    engine's ``preadv``/``pwritev`` take it."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError("host_view of device memory")
        return memoryview(tensor_bytes(buf).numpy())
    return memoryview(buf).cast("B")
