"""POSIX I/O engine: ``preadv``/``pwritev`` straight into and out of page memory.

Made by ``gdskv.io.make_engine`` when the config asks for ``engine = "posix"`` (or ``"auto"`` finds
no CUDA driver or no kvikio). The transfer layer's threads call ``read_now``/``write_now`` once per
page; ``read``/``write`` run the same calls on this engine's thread pool.

CPU page memory is read and written in place (zero-copy); a call whose segments are all in host
memory and lie end to end in the file (a chunk's regions and trailer) is one ``preadv`` (or, with
buffered writes, one ``pwritev``). Device memory goes through a host staging buffer (one per
thread, pinned where CUDA is present).

With ``o_direct`` the engine writes every segment whose address, file offset and length are
``ALIGN``-aligned with ``O_DIRECT``; the rest (a chunk's trailer) goes through the page cache.
With ``direct_reads`` too, a chunk that is mostly not in the page cache (``cachestat``) is read
with ``O_DIRECT`` in one ``preadv``: aligned host segments in place, everything after the first
unaligned one (the trailer, device memory, torch's 64-byte-aligned CPU tensors) into the staging
buffer, which is then copied out. The native batch path (``gdskv.io.batch``) judges "aligned" by
the file system's own direct-I/O memory alignment (``statx``'s ``STATX_DIOALIGN``): on NVMe
torch's tensors are read and written in place; on virtio disks (512 bytes) they are staged. A chunk at least half cached is read from the cache: on the
dev VM the kernel reclaimed single pages of warm chunks (23% of 2048 chunks had lost their last,
partial page, the trailer's, with memory to spare), and a rule of "wholly cached" then sent each
of them to the disk whole for one 4 KiB page. Why direct reads at all: on the disks
measured here throughput follows the size of each device request; a cold buffered read of a chunk
goes out in several requests (1 MiB chunks: 1.4 on average), one ``O_DIRECT`` read into
huge-page-backed memory of a chunk written by this engine in exactly one (4 KiB pages would cap a
request at the queue's 254 segments). The store's cold 4 MiB loads went from 1.25-1.5 GB/s
buffered to 2.0-2.3 GB/s direct (``gdskv.bench``). ``aligned_host_buffer`` makes such memory;
the staging buffer of a CPU-only process is one.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from gdskv.confined import open_data_file, umask_may_strip
from gdskv.io import batch as batchio
from gdskv.io.base import Buffer, IoEngine, Segment, ShortReadError, host_view, tensor_bytes

ALIGN = 4096
log = logging.getLogger(__name__)


class PosixEngine(IoEngine):
    """Chunk-file I/O with ``preadv``/``pwritev``; one instance per worker process."""

    name = "posix"

    def __init__(self, threads: int = 8, o_direct: bool = False, fsync: bool = False,
                 direct_reads: bool = True, file_mode: int = 0o600):
        """``threads``: the pool behind ``read``/``write`` (``read_now``/``write_now`` use none).
        ``o_direct``: move aligned segments with ``O_DIRECT``; ``direct_reads``: reads too, not
        only writes (no effect without ``o_direct``). ``fsync``: flush each written file before
        the call returns. ``file_mode``: permissions of the files it creates."""
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-posix")
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.direct_reads = self.o_direct and direct_reads
        self.fsync = fsync
        self.file_mode = file_mode
        self._bounce = threading.local()
        self._batch_buffers: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def _staging(self, nbytes: int) -> torch.Tensor:
        """This thread's page-aligned host buffer, grown to ``nbytes``: pinned where CUDA is
        present (device segments are copied through it), huge-page-backed otherwise."""
        return self._staging_pair(nbytes)[0][:nbytes]

    def _staging_pair(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """``_staging``'s whole buffer as a tensor and as a byte view (made once per growth: the
        direct read path slices the view, cheaper than tensor slicing on every page)."""
        pair = getattr(self._bounce, "pair", None)
        if pair is None or pair[0].numel() < nbytes:
            buf = staging_buffer(nbytes)
            pair = self._bounce.pair = (buf, memoryview(buf.numpy()))
        return pair

    def read(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._pool.submit(self.read_now, path, list(segments))

    def write(self, path: str, segments: Sequence[Segment]) -> "Future[int]":
        return self._pool.submit(self.write_now, path, list(segments))

    @property
    def batches_chunks(self) -> bool:
        return batchio.available()

    def read_chunks_now(self, root_fd: int, jobs: Sequence[tuple], threads: int = 1) -> list[batchio.ReadResult]:
        if not self.direct_reads:
            return batchio.read_chunks(root_fd, jobs, False, threads)
        with self._batch_staging(batchio.chunk_sizes(jobs, 1), threads) as staging:
            return batchio.read_chunks(root_fd, jobs, True, threads, staging)

    def write_chunks_now(self, root_fd: int, jobs: Sequence[tuple[str, str, str, Sequence[batchio.Piece]]],
                         threads: int = 1, dir_mode: Optional[int] = None) -> list[int]:
        mode, chmod = self.file_mode, umask_may_strip(self.file_mode)
        dirs = {"dir_mode": dir_mode, "dir_chmod": dir_mode is not None and umask_may_strip(dir_mode)}
        if not self.o_direct:
            return batchio.write_chunks(root_fd, jobs, mode, chmod, self.fsync, False, threads, **dirs)
        with self._batch_staging(batchio.chunk_sizes(jobs, 3), threads) as staging:
            return batchio.write_chunks(root_fd, jobs, mode, chmod, self.fsync, True, threads, staging, **dirs)

    def read_chunks_later(self, completions: Any, root_fd: int, jobs: Sequence[tuple], threads: int, nice: int,
                          tag: Any) -> None:
        buf, need = self._take_staging(batchio.chunk_sizes(jobs, 1), threads) if self.direct_reads else (None, 0)
        try:
            batchio.read_later(completions, root_fd, jobs, self.direct_reads, threads,
                               (0, 0) if buf is None else (buf.data_ptr(), need), nice, (tag, buf))
        except BaseException:
            if buf is not None:
                self._batch_buffers.put(buf)
            raise

    def write_chunks_later(self, completions: Any, root_fd: int, jobs: Sequence[tuple], threads: int,
                           dir_mode: Optional[int], nice: int, tag: Any) -> None:
        mode, chmod = self.file_mode, umask_may_strip(self.file_mode)
        buf, need = self._take_staging(batchio.chunk_sizes(jobs, 3), threads) if self.o_direct else (None, 0)
        try:
            batchio.write_later(completions, root_fd, jobs, mode, chmod, self.fsync, self.o_direct, threads,
                                (0, 0) if buf is None else (buf.data_ptr(), need), dir_mode,
                                dir_mode is not None and umask_may_strip(dir_mode), nice, (tag, buf))
        except BaseException:
            if buf is not None:
                self._batch_buffers.put(buf)
            raise

    def copy_later(self, completions: Any, copies: Sequence[tuple[int, int, int]], threads: int, nice: int,
                   tag: Any) -> None:
        batchio.copy_later(completions, copies, threads, nice, (tag, None))

    def collect_done(self, completions: Any) -> list[tuple[Any, Optional[list]]]:
        out = []
        for (tag, buf), results in batchio.collect(completions):
            if buf is not None:
                self._batch_buffers.put(buf)
            out.append((tag, results))
        return out

    @contextlib.contextmanager
    def _batch_staging(self, chunk_sizes: Sequence[int], threads: int) -> Iterator[batchio.Piece]:
        """A staging buffer (huge pages, or pinned under CUDA) of what a native call moving
        chunks of these sizes on ``threads`` threads stages in, for the call (``_take_staging``)."""
        buf, need = self._take_staging(chunk_sizes, threads)
        try:
            yield buf.data_ptr(), need
        finally:
            self._batch_buffers.put(buf)

    def _take_staging(self, chunk_sizes: Sequence[int], threads: int) -> tuple[torch.Tensor, int]:
        """A staging buffer for a native call moving chunks of these sizes on ``threads`` threads,
        and the bytes of it the call uses: taken from this engine's pool of them, which the caller
        puts it back into once the call finished, so buffers are reused across calls (no call
        faults in fresh memory, no O_DIRECT request is cut at 4 KiB pages) and there are only as
        many as calls ever ran at once, whichever threads made them."""
        need = batchio.staging_need(chunk_sizes, threads)
        try:
            buf = self._batch_buffers.get_nowait()
        except queue.Empty:
            buf = None
        if buf is None or buf.numel() < need:
            buf = staging_buffer(need)
        return buf, need

    def read_now(self, path: str, segments: Sequence[Segment]) -> int:
        fd = open_data_file(path, write=False)
        try:
            if self.direct_reads and _direct_candidate(segments) and not _cached(fd, segments) and self._set_direct(fd, path):
                return self._read_direct(path, fd, segments)
            views = _host_views_end_to_end(segments)
            if views is not None:
                return _read_exactly(path, fd, views, segments[0].file_offset)
            total = 0
            for seg in segments:
                staged = self._staging(seg.nbytes) if _on_device(seg.buf) else None
                total += _read_exactly(path, fd, [host_view(seg.buf if staged is None else staged)], seg.file_offset)
                if staged is not None:
                    tensor_bytes(seg.buf).copy_(staged)
            return total
        finally:
            os.close(fd)

    def _read_direct(self, path: str, dfd: int, segments: Sequence[Segment]) -> int:
        """Read end-to-end ``segments`` (the first at an aligned offset) through the ``O_DIRECT``
        descriptor ``dfd`` with one ``preadv``: the leading aligned host segments in place, the
        rest into the staging buffer (rounded up to ``ALIGN``; the file's end cuts the read
        short) and copied out. Runs once per cold page: kept to a few Python operations, since
        under many transfer threads every one of them delays the next request."""
        iov: list[memoryview] = []
        k = 0
        for seg in segments:
            view = _direct_view(seg.buf)
            if view is None:
                break
            iov.append(view)
            k += 1
        rest = segments[k:]
        want = sum(seg.nbytes for seg in segments)
        tail = want - sum(v.nbytes for v in iov)
        if rest:
            span = -(-tail // ALIGN) * ALIGN
            staged, staged_view = self._staging_pair(span)
            iov.append(staged_view[:span])
        n = os.preadv(dfd, iov, segments[0].file_offset)
        if n < want:  # a regular file reads short only at its end
            raise ShortReadError(f"{path}: wanted {want} bytes at {segments[0].file_offset}, file had {n}")
        pos = 0
        for seg in rest:
            nbytes = seg.nbytes
            if _on_device(seg.buf):
                tensor_bytes(seg.buf).copy_(staged[pos:pos + nbytes])
            else:
                host_view(seg.buf)[:] = staged_view[pos:pos + nbytes]
            pos += nbytes
        return want

    def write_now(self, path: str, segments: Sequence[Segment]) -> int:
        fd = open_data_file(path, write=True, mode=self.file_mode)
        dfd = None
        try:
            dfd = self._open_direct(fd, path) if self.o_direct and any(map(_direct_writable, segments)) else None
            if dfd is not None and segments:
                _preallocate(fd, path, max(seg.file_offset + seg.nbytes for seg in segments))
            views = _host_views_end_to_end(segments) if dfd is None else None
            if views is not None:
                total = _write_exactly(path, fd, views, segments[0].file_offset)
            else:
                total = 0
                for seg in segments:
                    if _on_device(seg.buf):
                        staged = self._staging(seg.nbytes)
                        staged.copy_(tensor_bytes(seg.buf))
                        view = host_view(staged)
                    else:
                        view = host_view(seg.buf)
                    use = dfd if dfd is not None and _aligned(view, seg.file_offset) else fd
                    total += _write_exactly(path, use, [view], seg.file_offset)
            if self.fsync:
                os.fsync(fd)
            return total
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def _open_direct(self, fd: int, path: str) -> Optional[int]:
        """A second, O_DIRECT descriptor of the regular file open at ``fd`` (reopened through
        ``/proc/self/fd``, so it is that very file), or None where the file system refuses
        O_DIRECT (see ``_direct_refused``)."""
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct_refused(path)
            return None

    def _set_direct(self, fd: int, path: str) -> bool:
        """Switch the regular file open at ``fd`` to O_DIRECT; False where refused."""
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct_refused(path)
            return False

    def _direct_refused(self, path: str) -> None:
        """The file system of a regular file refused O_DIRECT (tmpfs, some network file
        systems): this engine turns direct I/O off for good and says so once. Only ever asked
        of a file already checked to be regular, so a directory or a device at a chunk path
        cannot switch it off."""
        if self.o_direct:
            log.warning("gdskv: %s does not support O_DIRECT; the POSIX engine uses buffered I/O", os.path.dirname(path))
        self.o_direct = self.direct_reads = False

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def staging_buffer(nbytes: int) -> torch.Tensor:
    """Page-aligned host memory for staging: pinned where CUDA is present (device segments are
    copied through it), huge-page-backed otherwise. Called by this engine and by
    ``PageTransfer`` / ``SliceStaging`` for their staging buffers."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.frombuffer(aligned_host_buffer(nbytes), dtype=torch.uint8)


def _on_device(buf: Buffer) -> bool:
    return isinstance(buf, torch.Tensor) and buf.device.type != "cpu"


def _aligned(view: memoryview, file_offset: int) -> bool:
    """Whether O_DIRECT can move this span: address, file offset and length are multiples of
    ``ALIGN`` (read-only memory, a ``bytes`` trailer, never goes direct)."""
    if view.readonly or not view.nbytes or view.nbytes % ALIGN or file_offset % ALIGN:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


def _direct_writable(seg: Segment) -> bool:
    """Whether ``write_now`` would move this segment with O_DIRECT: aligned offset and length,
    and aligned host memory or device memory (staged through the aligned staging buffer). A call
    with none (a plain torch CPU pool: 64-byte-aligned memory) opens no O_DIRECT descriptor and
    preallocates nothing: two system calls and a file-system round trip per page saved."""
    nbytes = seg.nbytes
    if not nbytes or nbytes % ALIGN or seg.file_offset % ALIGN:
        return False
    return _on_device(seg.buf) or _aligned(host_view(seg.buf), seg.file_offset)


def _preallocate(fd: int, path: str, nbytes: int) -> None:
    """Allocate the file's blocks in one piece before a direct write. Without it the buffered
    trailer's block is allocated at writeback, away from the payload's, and every cold load of
    the chunk costs a second, distant device request (measured: the store's cold 1 MiB loads
    went from 1.33 to 1.56 GB/s with it). A full disk raises ENOSPC here, before any byte moves;
    file systems without ``fallocate`` are left to allocate as they write."""
    if _libc.fallocate(ctypes.c_int(fd), ctypes.c_int(0), ctypes.c_long(0), ctypes.c_long(nbytes)) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err), path)


def _direct_view(buf: Buffer) -> Optional[memoryview]:
    """A byte view of ``buf`` when O_DIRECT can read into it in place (host memory whose address
    and length are ``ALIGN``-aligned), else None."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        nbytes = buf.numel() * buf.element_size()
        if not nbytes or nbytes % ALIGN or buf.data_ptr() % ALIGN:
            return None
        return host_view(buf)
    view = memoryview(buf).cast("B")
    return view if _aligned(view, 0) else None


def _end_to_end(segments: Sequence[Segment]) -> bool:
    """Whether each segment starts in the file where the previous one ends (a chunk's regions
    and trailer), so one call can move them all."""
    pos = segments[0].file_offset if segments else 0
    for seg in segments:
        if seg.file_offset != pos:
            return False
        pos += seg.nbytes
    return True


def _direct_candidate(segments: Sequence[Segment]) -> bool:
    """Whether ``_read_direct`` can take these segments: end to end from an aligned offset."""
    return bool(segments) and segments[0].file_offset % ALIGN == 0 and _end_to_end(segments)


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # the same number on every Linux architecture (Linux 6.5+)
_libc = ctypes.CDLL(None, use_errno=True)
_cachestat_works = sys.platform.startswith("linux")


CACHED_PROBE_BYTES = 256 * 1024
"""How much of a chunk's head ``_cached`` asks about (``_batchio.c``: its ``READ_STEP``)."""


def _cached(fd: int, segments: Sequence[Segment]) -> bool:
    """Whether most of the head of the file span of ``segments`` (its first
    ``CACHED_PROBE_BYTES``) is in the page cache: at least half its pages, as ``_batchio.c``
    decides. ``cachestat(2)`` walks every folio of the range it is asked about, and chunks are
    written and read whole, so the head tells; a chunk with its trailer's page reclaimed is still
    read through the cache. No I/O, unlike a probing ``RWF_NOWAIT`` read, which starts readahead.
    False where the kernel lacks it (before 6.5): then every read goes direct."""
    global _cachestat_works
    if not _cachestat_works:
        return False
    start = segments[0].file_offset
    end = min(start + CACHED_PROBE_BYTES, max(seg.file_offset + seg.nbytes for seg in segments))
    span, stat = _CacheStatRange(start, end - start), _CacheStat()
    if _libc.syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span),
                     ctypes.byref(stat), ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _cachestat_works = False
        return False
    return stat.nr_cache * 2 >= -(-(end - start) // mmap.PAGESIZE)


def _host_views_end_to_end(segments: Sequence[Segment]) -> Optional[list[memoryview]]:
    """Byte views of the segments when all are host memory and each starts where the previous
    one ends in the file (a chunk's regions and trailer), so one call moves them all; else None."""
    if not segments or not _end_to_end(segments) or any(_on_device(seg.buf) for seg in segments):
        return None
    return [host_view(seg.buf) for seg in segments]


def _read_exactly(path: str, fd: int, views: list[memoryview], offset: int) -> int:
    want = sum(v.nbytes for v in views)
    n = move_all(os.preadv, fd, views, offset)
    if n != want:
        raise ShortReadError(f"{path}: wanted {want} bytes at {offset}, file had {n}")
    return n


def _write_exactly(path: str, fd: int, views: list[memoryview], offset: int) -> int:
    want = sum(v.nbytes for v in views)
    n = move_all(os.pwritev, fd, views, offset)
    if n != want:
        raise OSError(errno.EIO, f"wrote {n} of {want} bytes at {offset}", path)
    return n


def move_all(op: Callable[[int, list[memoryview], int], int], fd: int, views: list[memoryview], offset: int) -> int:
    """``op`` (``os.preadv`` or ``os.pwritev``) from ``offset`` until every view is done, or a
    call moves nothing (a read at the end of the file); the bytes moved. Also the raw baseline's
    loop in ``gdskv.bench``."""
    done = 0
    while views:
        n = op(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if views and n:
            views = [views[0][n:]] + views[1:]
    return done


HUGE_PAGE = 2 << 20


def aligned_host_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of private anonymous host memory aligned to 2 MiB and advised to use
    transparent huge pages, so that O_DIRECT accepts it and each request can span a whole chunk
    (with 4 KiB pages a request stops at the queue's segment limit, 254 x 4 KiB on virtio).
    Called for the staging buffers of CPU-only processes, by ``gdskv.bench.page_pool`` for the
    benchmark's page pools and by the engine tests (torch's own CPU allocations are only 64-byte
    aligned). The mapping holds whole huge pages past the aligned start: the kernel backs an
    address with a huge page only where the aligned 2 MiB around it lies inside the mapping, so a
    mapping of ``nbytes`` + 2 MiB left the tail of a small buffer (a native call's staging, ~1
    MiB) on 4 KiB pages whenever the start fell late in the mapping's first huge page."""
    whole = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, whole + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    return memoryview(region)[start:start + nbytes]
