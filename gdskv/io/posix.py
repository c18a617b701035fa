"""POSIX I/O engine: a thread pool doing ``preadv``/``pwritev`` straight into page memory.

CPU page memory is read and written in place (zero-copy). Device memory goes through pinned
host bounce buffers (one per in-flight call) when CUDA is present. With ``o_direct`` the engine
opens files with ``O_DIRECT`` and moves aligned spans directly; unaligned tails (a chunk's
trailer) go through a second, buffered descriptor. ``direct_reads=False`` keeps reads buffered
while writes go direct (kvikio's default policy): measured on this project's disks, direct writes
make a durable save 2-4x faster than buffered writes plus writeback, while direct reads lose the
page cache's warm hits and win nothing cold (see ``gdskv.bench``).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from gdskv.io.base import IoEngine, Segment, ShortReadError, host_view

ALIGN = 4096
log = logging.getLogger(__name__)


def _aligned(view: memoryview, file_offset: int) -> bool:
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    return addr is not None and addr % ALIGN == 0 and file_offset % ALIGN == 0 and view.nbytes % ALIGN == 0


class PosixEngine(IoEngine):
    """Called by the transfer layer; one instance per worker process."""

    name = "posix"

    def __init__(self, threads: int = 8, o_direct: bool = False, fsync: bool = False,
                 direct_reads: bool | None = None):
        """``direct_reads``: whether reads use O_DIRECT too when ``o_direct`` is on (None: yes)."""
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-posix")
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.direct_reads = self.o_direct and (direct_reads is None or direct_reads)
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

    def read_now(self, path: str, segments: Sequence[Segment]) -> int:
        return self._read(path, list(segments))

    def write_now(self, path: str, segments: Sequence[Segment]) -> int:
        return self._write(path, list(segments))

    def _open_direct(self, path: str, flags: int) -> Optional[int]:
        """An O_DIRECT descriptor, or None where the file system refuses O_DIRECT (tmpfs, some
        network file systems): then this engine turns direct I/O off for good and says so once."""
        try:
            return os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            if self.o_direct:
                log.warning("gdskv: %s does not support O_DIRECT; the POSIX engine uses buffered I/O", os.path.dirname(path))
            self.o_direct = self.direct_reads = False
            return None

    def _read(self, path: str, segments: list[Segment]) -> int:
        fd = os.open(path, os.O_RDONLY)
        dfd = self._open_direct(path, os.O_RDONLY) if self.direct_reads else None
        try:
            if dfd is None and _contiguous_host(segments):
                views = [host_view(seg.buf) for seg in segments]
                want = sum(v.nbytes for v in views)
                n = _preadv_full(fd, views, segments[0].file_offset)
                if n != want:
                    raise ShortReadError(f"{path}: wanted {want} bytes at {segments[0].file_offset}, file had {n}")
                return n
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
        dfd = self._open_direct(path, os.O_WRONLY) if self.o_direct else None
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


def _contiguous_host(segments: list[Segment]) -> bool:
    """Host memory only, and each segment starts where the previous one ends in the file (a
    chunk's regions and trailer): then one ``preadv`` reads the whole chunk in one request."""
    pos = segments[0].file_offset if segments else 0
    for seg in segments:
        if seg.file_offset != pos or (isinstance(seg.buf, torch.Tensor) and seg.buf.device.type != "cpu"):
            return False
        pos += seg.nbytes
    return bool(segments)


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """``preadv`` into ``views`` until they are full or the file ends; bytes read."""
    done = 0
    while views:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if views and n:
            views = [views[0][n:]] + views[1:]
    return done


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
