"""The I/O engine interface: move bytes between memory (host or device) and files, asynchronously.

An engine knows nothing about chunks, keys or checksums; the store's transfer layer
(``gdskv.transfer``) builds chunk files out of these calls. Every call returns a
``concurrent.futures.Future`` that resolves to the number of bytes moved, or raises ``OSError``
(a short read is ``ShortReadError``).

A ``Segment`` is one contiguous memory range and its place in the file. Memory is a 1-D
contiguous ``torch.uint8`` tensor on any device (a page slot from ``region.slot_tensor``), or any
host buffer-protocol object (a chunk trailer). Segments of one call all belong to one file, so an
engine opens that file once per call.
"""
from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence, Union

import torch

Buffer = Union[torch.Tensor, bytes, bytearray, memoryview]


class ShortReadError(OSError):
    """The file ended before every requested byte was read (a truncated chunk)."""


@dataclass(frozen=True)
class Segment:
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
        """``read`` on the calling thread. The transfer layer's threads call this, so a page costs
        no hand-off to a second thread; engines that can do better than ``read(...).result()``
        (the POSIX engine) override it."""
        return self.read(path, segments).result()

    def write_now(self, path: str, segments: Sequence[Segment]) -> int:
        """``write`` on the calling thread (see ``read_now``)."""
        return self.write(path, segments).result()

    def read_batch(self, ops: Sequence[tuple[str, Sequence[Segment]]]) -> list["Future[int]"]:
        return [self.read(path, segs) for path, segs in ops]

    def write_batch(self, ops: Sequence[tuple[str, Sequence[Segment]]]) -> list["Future[int]"]:
        return [self.write(path, segs) for path, segs in ops]

    def close(self) -> None:
        """Wait for in-flight calls and release threads and handles."""

    def describe(self) -> str:
        return f"{self.name} (GDS {'active' if self.gds_active else 'inactive'})"


def host_view(buf: Buffer) -> memoryview:
    """A writable byte view of host memory (a CPU tensor, bytearray, ...); zero-copy."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError("host_view of device memory")
        if not buf.is_contiguous():
            raise ValueError("segment memory must be contiguous")
        return memoryview(buf.view(torch.uint8).reshape(-1).numpy()).cast("B")
    return memoryview(buf).cast("B")
