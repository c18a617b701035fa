"""POSIX I/O engine: a thread pool doing ``preadv``/``pwritev`` straight into page memory.

CPU page memory is read and written in place (zero-copy). Device memory goes through pinned
host bounce buffers (one per in-flight call) when CUDA is present. With ``o_direct`` the engine
opens files with ``O_DIRECT`` and moves aligned spans directly; unaligned tails (a chunk's
trailer) go through a second, buffered descriptor.
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from gdskv.io.base import IoEngine, Segment, ShortReadError, host_view

ALIGN = 4096


def _aligned(view: memoryview, file_offset: int) -> bool:
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    return addr is not None and addr % ALIGN == 0 and file_offset % ALIGN == 0 and view.nbytes % ALIGN == 0


class PosixEngine(IoEngine):
    """Called by the transfer layer; one instance per worker process."""

    name = "posix"

    def __init__(self, threads: int = 8, o_direct: bool = False, fsync: bool = False):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-posix")
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._bounce = threading.local()

    # --- memory -----------------------------------------------------------------------------
    def _staging(self, nbytes: int) -> torch.Tensor:
        """A per-thread pinned host buffer for device segments."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._bounce.buf = buf
        return buf[:nbytes]

    # --- the two calls ----------------------------------------------------------------------
    def read(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._pool.submit(self._read, path, list(segments))

    def write(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._pool.submit(self._write, path, list(segments))

    def _read(self, path: str, segments: list[Segment]) -> int:
        fd = os.open(path, os.O_RDONLY)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT) if self.o_direct else None
        try:
            total = 0
            for seg in segments:
                dev = isinstance(seg.buf, torch.Tensor) and seg.buf.device.type != "cpu"
                target = self._staging(seg.nbytes) if dev else seg.buf
                view = host_view(target)
                use = dfd if dfd is not None and _aligned(view, seg.file_offset) else fd
                n = _pread_full(use, view, seg.file_offset)
                if n != view.nbytes:
                    raise ShortReadError(f"{path}: wanted {view.nbytes} bytes at {seg.file_offset}, file had {n}")
                if dev:
                    seg.buf.copy_(target, non_blocking=False)
                total += n
            return total
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def _write(self, path: str, segments: list[Segment]) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        dfd = os.open(path, os.O_WRONLY | os.O_DIRECT) if self.o_direct else None
        try:
            total = 0
            for seg in segments:
                if isinstance(seg.buf, torch.Tensor) and seg.buf.device.type != "cpu":
                    staged = self._staging(seg.nbytes)
                    staged.copy_(seg.buf.reshape(-1).view(torch.uint8))
                    view = host_view(staged)
                else:
                    view = host_view(seg.buf)
                use = dfd if dfd is not None and _aligned(view, seg.file_offset) else fd
                total += _pwrite_full(use, view, seg.file_offset)
            if self.fsync:
                os.fsync(fd)
            return total
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pwrite_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        done += os.pwritev(fd, [view[done:]], offset + done)
    return done


def aligned_host_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory, for O_DIRECT-friendly host buffers."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]
