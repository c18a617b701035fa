"""Batched chunk reads and writes in one native call per slice of pages (``_batchio.c``).

``gdskv.io.posix.PosixEngine.read_chunks_now``/``write_chunks_now`` call ``read_chunks``/
``write_chunks`` for ``gdskv.transfer``'s threads with a slice of a step's pages when the batch
path applies: host page memory, the POSIX engine, google-crc32c's C library and the compiled
extension present; ``gdskv.store`` calls ``stat_chunks``/``lease_chunks`` for a lookup. The extension resolves every path
beneath the store's root descriptor without following links (as ``gdskv.confined`` does), moves
the bytes and checksums the payload with the GIL released for the whole slice, so concurrent
transfer threads and the engine's own Python run while pages move. A job that fails reports its
errno; the caller redoes that page on the per-page Python path, which classifies the failure.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Any, NamedTuple, Optional, Sequence

from gdskv import format as fmt

try:
    from gdskv.io import _batchio
except ImportError:  # built without a C compiler: the per-page path does the work
    _batchio = None

ALIGN = 4096
_EXPECT_HEAD = struct.Struct("<II")
ERR_SHORT = -1
ERR_NOT_REGULAR = -2
ERR_PRESENT = -3  # a write job's chunk was stored already (its ``present`` size): nothing written
MAX_PIECES = 64
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM)  # no openat2 (old kernel, seccomp): per-page path for good


_CRC = fmt.crc32c_address() if _batchio is not None else 0
_working = _batchio is not None and _CRC != 0

Piece = tuple[int, int]
"""One span of host memory, ``(address, length)``; a chunk's pieces lie end to end in its file."""


class ReadResult(NamedTuple):
    """``err``: 0 when every byte was read, else an errno, ``ERR_SHORT`` or ``ERR_NOT_REGULAR``;
    ``crc``: CRC32C of every piece but the last (the trailer), valid when ``err`` is 0;
    ``verified``: the job had an ``expect`` and the trailer says exactly that, with ``crc``;
    ``copied``: the payload was copied into the job's ``outs`` (not when it had none, or had
    ``outs_cold`` and the page cache served the chunk). A tuple rather than a dataclass: one per
    page, made on the transfer threads' GIL time."""

    err: int
    crc: int
    verified: bool = False
    copied: bool = False


def available() -> bool:
    """Whether the batch path can run in this process."""
    return _working


def _note(errs: Sequence[int]) -> None:
    global _working
    if errs and all(e in _UNSUPPORTED for e in errs):
        _working = False


def staging_need(chunk_sizes: Sequence[int], threads: int) -> int:
    """Bytes of aligned staging memory a call moving chunks of these sizes (pieces and trailer)
    on ``threads`` native threads uses, one part per thread."""
    return _batchio.staging_need(list(chunk_sizes), threads)


def chunk_sizes(jobs: Sequence[tuple], pieces_at: int) -> list[int]:
    """The chunk size of each job, whose pieces are its item ``pieces_at``."""
    return [sum(n for _, n in job[pieces_at]) for job in jobs]


def read_chunks(root_fd: int, jobs: Sequence[tuple], direct: bool, threads: int = 1,
                staging: Piece = (0, 0)) -> list[ReadResult]:
    """Read each job's chunk (``(rel, pieces)``, ``rel`` its path from the store root, or
    ``(rel, pieces, outs[, expect[, outs_cold]]])``) into its pieces and checksum the payload, on
    ``threads`` native threads; ``outs`` (or None), pieces of the payload's length in all, get a
    copy of the payload (made step by step right after each step is checksummed, while in cache;
    with ``outs_cold`` only when the chunk is not mostly in the page cache: ``ReadResult.copied``);
    ``expect`` (``expectation``) has the trailer verified there too (``ReadResult.verified``).
    ``direct``: chunks not mostly in the page cache are read with O_DIRECT (aligned pieces in
    place, the rest staged in ``staging``, ``(address, length)`` of ``staging_need`` aligned
    bytes, huge-page backed where possible). Called by ``PosixEngine``."""
    out = [ReadResult(err, crc, verified == 1, copied == 1) for err, crc, verified, copied in
           _batchio.read_chunks(root_fd, [(job[0].encode(), *job[1:]) for job in jobs], _CRC, direct, threads,
                                *staging)]
    _note([r.err for r in out])
    return out


def completions() -> Any:
    """A queue of reads, writes and copies that finish on threads of their own (``read_later``,
    ``write_later``, ``copy_later``) and are collected without waiting (``collect``):
    ``_batchio.Completions``.
    Made by ``PageTransfer`` for its saves and asynchronous loads, where ``available``."""
    return _batchio.Completions()


def read_later(queue: Any, root_fd: int, jobs: Sequence[tuple], direct: bool, threads: int, staging: Piece,
               nice: int, tag: Any) -> None:
    """``read_chunks`` started on ``threads`` threads of its own, niced by ``nice``, returning at
    once: its results come back with ``tag`` from ``collect(queue)`` once every job finished.
    The jobs' memory (pieces, outs, ``staging``) must stay untouched until then. Called by
    ``PosixEngine.read_chunks_later``."""
    queue.read_later(root_fd, [(job[0].encode(), *job[1:]) for job in jobs], _CRC, direct, threads, *staging, nice, tag)


def write_later(queue: Any, root_fd: int, jobs: Sequence[tuple], file_mode: int, chmod: bool, sync: bool,
                direct: bool, threads: int, staging: Piece, dir_mode: Optional[int], dir_chmod: bool, nice: int,
                tag: Any) -> None:
    """``write_chunks`` (jobs sealed the same way) started as ``read_later`` starts reads
    (errnos from ``collect``). Called by ``PosixEngine.write_chunks_later``."""
    queue.write_later(root_fd, [(d.encode(), t.encode(), n.encode(), *rest) for d, t, n, *rest in jobs], _CRC,
                      file_mode, chmod, sync, direct, threads, *staging, -1 if dir_mode is None else dir_mode,
                      dir_chmod, nice, tag)


def copy_later(queue: Any, copies: Sequence[tuple[int, int, int]], threads: int, nice: int, tag: Any) -> None:
    """``copy_many`` started as ``read_later`` starts reads (None for results in ``collect``).
    Called by ``PageTransfer.copy_later`` for host-tier hits of asynchronous loads."""
    queue.copy_later(list(copies), threads, nice, tag)


def collect(queue: Any) -> list[tuple[Any, Optional[list]]]:
    """``(tag, results)`` of every ``read_later``/``write_later``/``copy_later`` of ``queue``
    finished since the last collect (a ``ReadResult`` per read job, an errno per write job, as
    ``read_chunks`` and ``write_chunks`` give them; None for copies), without waiting for the
    others."""
    out = []
    for tag, results in queue.collect():
        if results is None:
            out.append((tag, None))
            continue
        if results and type(results[0]) is tuple:
            results = [ReadResult(err, crc, verified == 1, copied == 1) for err, crc, verified, copied in results]
            _note([r.err for r in results])
        else:
            _note(results)
        out.append((tag, results))
    return out


def expectation(group: int, nbytes: int, store_key: bytes, block_key: bytes) -> bytes:
    """A read job's ``expect``: the chunk is verified natively when its trailer is an
    unauthenticated version 2 one for exactly this group, payload length, store key and block
    key, with a CRC32C equal to the payload's (what ``gdskv.checksum.check_crc`` accepts without
    an auth key); any other chunk is left to that check."""
    return _EXPECT_HEAD.pack(group, nbytes) + bytes(store_key) + bytes(block_key)


def write_chunks(root_fd: int, jobs: Sequence[tuple], file_mode: int,
                 chmod: bool, sync: bool, direct: bool, threads: int = 1, staging: Piece = (0, 0),
                 dir_mode: Optional[int] = None, dir_chmod: bool = False) -> list[int]:
    """Write each job's pieces into ``dir/tmp`` (created exclusively with ``file_mode``;
    ``chmod``: set the mode again where the umask may have stripped it), ``fsync`` it when
    ``sync``, and rename it to ``dir/name``, on ``threads`` native threads; an errno per job (0:
    published). ``direct``: the chunk's whole 4 KiB blocks with O_DIRECT (staged when the pieces
    are not aligned, in ``staging`` as for ``read_chunks``), the rest after them through the page
    cache. ``dir_mode``: a missing ``dir`` is made, with its parents, with that mode (set again
    when ``dir_chmod``), each resolved beneath the root without following a link; None: the job
    fails with ``ENOENT``. A failed job leaves no file behind. A job ``(dir, tmp, name, pieces,
    True)`` is sealed there first: its last piece, a version 2 CRC32C trailer packed with a zero
    payload checksum, gets the payload's CRC32C and its own (as ``gdskv.format.pack`` makes
    them), so no Python thread checksums the page. A job ``(dir, tmp, name, pieces, seal, outs)``
    also has its payload copied into ``outs`` (pieces of the payload's length in all: the host
    tier's buffer for the page) in that same pass. A job ``(..., outs, present)`` with ``present``
    the size of a stored chunk writes nothing where a regular file of that size already has the
    name, and ends in ``ERR_PRESENT``. Called by ``PosixEngine``."""
    errs = _batchio.write_chunks(root_fd, [(d.encode(), t.encode(), n.encode(), *rest) for d, t, n, *rest in jobs],
                                 _CRC, file_mode, chmod, sync, direct, threads, *staging,
                                 -1 if dir_mode is None else dir_mode, dir_chmod)
    _note(errs)
    return errs


def copy_many(copies: Sequence[tuple[int, int, int]], threads: int) -> None:
    """Host-memory copies ``(dst, src, length)`` (addresses of memory the caller keeps alive), in
    1 MiB pieces on ``threads`` native threads without the GIL. Called by
    ``KvService.load_many`` for host-tier hits into plain host memory."""
    _batchio.copy_many(list(copies), threads)


class DirectIo(NamedTuple):
    """What ``statx`` says direct I/O asks on a file's file system (``memory``, ``offset``: the
    alignment of buffers and of file offsets; ``offset`` 0: no direct I/O there), and
    ``in_place``: the memory alignment at which the native reads and writes move a page in place
    there, by the rule they use themselves (the file system's alignment where it divides a
    page, else a page)."""

    memory: int
    offset: int
    in_place: int


def dio_alignment(path: str) -> Optional[DirectIo]:
    """The ``DirectIo`` of the regular file ``path``; None where the kernel does not say or the
    extension is not built. ``OSError`` when the file cannot be opened. Called by ``gdskv info``
    and ``gdskv bench``."""
    if _batchio is None:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        got = _batchio.dio_alignment(fd)
    finally:
        os.close(fd)
    return None if got is None else DirectIo(*got)


def copy_device(copies: Sequence[tuple[int, int, int]], memcpy_async: int, stream: int) -> int:
    """Copies ``(dst, src, length)`` between host and device memory (addresses of memory the
    caller keeps alive until the stream has run them) queued in order on the CUDA stream
    ``stream`` by the runtime's ``cudaMemcpyAsync`` (its address: ``memcpy_async``), in one call
    without the GIL: 0, or the first error code (the copies after it not queued). Called by
    ``gdskv.copies._queue_all`` with the current device set to the stream's."""
    return _batchio.copy_device(list(copies), memcpy_async, stream)


def stat_chunks(root_fd: int, base: str, store_keys: bytes, size: int) -> Optional[list[bool]]:
    """Whether the chunk of each 32-byte store key in ``store_keys`` (concatenated), beneath the
    array directory ``base`` (relative to the store root), is a regular file of ``size`` bytes,
    resolved beneath the root without following a link, in one call without the GIL (the
    chunks named natively as ``gdskv.format.chunk_relpath`` names them); None where the kernel
    refuses ``openat2`` (the caller's Python path answers). Called by ``Namespace.contains_many``."""
    got = _batchio.stat_chunks(root_fd, base.encode(), store_keys, fmt.HI_BITS, fmt.LO_BITS, size)
    return None if -1 in got else [g == 1 for g in got]


def chunk_mtimes(root_fd: int, base: str, store_keys: bytes, size: int) -> Optional[list[Optional[int]]]:
    """The mtime (ns) of each store key's chunk, found as ``stat_chunks`` finds it, where it is a
    regular file of ``size`` bytes (else None), in one call without the GIL; None where the
    kernel refuses ``openat2``. Called by ``Namespace.chunk_mtimes``."""
    got = _batchio.chunk_mtimes(root_fd, base.encode(), store_keys, fmt.HI_BITS, fmt.LO_BITS, size)
    return None if -2 in got else [None if g < 0 else g for g in got]


def lease_chunks(root_fd: int, base: str, store_keys: bytes, atime_ns: int, mtime_ns: int, check: bool,
                 size: int = 0) -> Optional[list[bool]]:
    """Set the times of key ``i``'s chunk (found as ``stat_chunks`` finds it) to
    ``(atime_ns + i, mtime_ns + i)`` (never a link's target); per key whether that landed and,
    with ``check``, whether its atime is still at or past ``atime_ns`` afterwards, and with
    ``size``, whether it is a regular file of ``size`` bytes; None where the kernel refuses
    ``openat2``. Called by ``Namespace.lease_many``."""
    got = _batchio.lease_chunks(root_fd, base.encode(), store_keys, fmt.HI_BITS, fmt.LO_BITS, atime_ns, mtime_ns,
                                check, size)
    return None if -1 in got else [g == 1 for g in got]


def host_pages(tensors: Sequence) -> bool:
    """Whether the batch path can take a page's tensors: contiguous CPU tensors, not too many
    (the per-page path handles the rest)."""
    return len(tensors) < MAX_PIECES and all(t.is_cpu and t.is_contiguous() for t in tensors)


def address_of(buf: bytearray) -> int:
    """The address of a (non-empty) bytearray's bytes, valid while it lives and keeps its size:
    where a native job's trailer piece points (``PageTransfer`` packs a step's trailers into one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def pieces_at(tensors: Sequence, trailer_address: int, trailer_nbytes: int = fmt.TRAILER_BYTES) -> list[Piece]:
    """The pieces of a page's tensors (ones ``host_pages`` takes) and of its trailer at
    ``trailer_address``. Called by ``PageTransfer`` for a step's saves, whose trailers lie end to
    end in one buffer, and by ``pieces_of``."""
    out = [(t.data_ptr(), t.nbytes) for t in tensors]
    out.append((trailer_address, trailer_nbytes))
    return out


def pieces_of(tensors: Sequence, trailer: bytearray) -> Optional[list[Piece]]:
    """The pieces of a page's tensors and its trailer, or None when ``host_pages`` refuses them."""
    return pieces_at(tensors, address_of(trailer), len(trailer)) if host_pages(tensors) else None
