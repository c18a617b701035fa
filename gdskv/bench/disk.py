"""The page cache, durability, directories and page pools of a bench run.

Used by ``gdskv.bench.rounds`` and the subjects, and by ``scripts/bench_ttft.py`` (dropping and
filling the page cache, directories placed apart), ``scripts/bench_lookup.py`` (``ChunkWriter``).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Optional, Sequence

import torch

from gdskv.bench.options import POOLS
from gdskv.io.posix import PosixEngine, aligned_host_buffer
from gdskv.store import Namespace
from gdskv.transfer import PageTransfer, SaveStatus


_LIBC = ctypes.CDLL(None, use_errno=True)


def sync_directory_fs(directory: Path) -> None:
    """Flush every dirty page of the file system holding ``directory`` (``syncfs``)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        if getattr(_LIBC, "syncfs", None) is None or _LIBC.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000


def spread_directories(directory: Path) -> bool:
    """Have the file system place each directory made in ``directory`` as it places top-level
    ones: spread over the disk by the name's hash, not next to its parent (ext4's Orlov allocator
    and the ``T`` attribute, ``chattr +T``). True where it took; False where the file system has
    no such attribute (nothing changed). Called by ``_run`` on the run's scratch directory, whose
    round directories have random names, and by ``scripts/bench_ttft.py`` on its work directory.

    Why: on ext4 without a journal, creating a file scans past every inode of its group freed in
    the last 60-300 s (``recently_deleted`` in ``find_inode_bit``). Each round removes its
    directory, so the next subject's one-file-per-page save paid a scan over the previous
    subject's thousands of freed inodes on every create (1-2 s for 4096 creates where 0.07 s is
    the cost in a fresh group), while the one-file baselines did not. Spread directories make
    that rare, not impossible: the allocator favours groups with few directories, which a group
    just emptied can be."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        wanted = int.from_bytes(flags[:4], sys.byteorder) | _FS_TOPDIR_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, wanted.to_bytes(4, sys.byteorder) + bytes(4))
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return bool(int.from_bytes(flags[:4], sys.byteorder) & _FS_TOPDIR_FL)
    except OSError:
        return False
    finally:
        os.close(fd)


def drop_page_cache(paths: Sequence[str]) -> None:
    """Evict the (clean) cached pages of these files, so the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fill_page_cache(paths: Sequence[str]) -> None:
    """Read these files through the page cache twice (untimed), so a warm load finds them there
    and finds them alike for every subject: on the active LRU list, as pages read again and again
    are. Read once, pages are only marked referenced and the next read moves them to the active
    list, a cost (12-26% of a 4 MiB page's warm read here) that a single fill charged to the warm
    load of a subject whose cold load bypassed the cache (O_DIRECT) and not to one whose cold load
    had read the pages through it."""
    scratch = bytearray(4 << 20)
    for _ in range(2):
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                while os.readv(fd, [scratch]) == len(scratch):
                    pass
            finally:
                os.close(fd)


class ChunkWriter:
    """Valid chunks, many of them, published through ``PageTransfer.save_page``: the transfer
    layer's one chunk writer (temp file, trailer with checksum and keys, rename), so a benchmark
    store holds exactly the files a store in service holds. How ``scripts/bench_lookup.py`` and
    ``scripts/bench_eviction.py`` grow stores to a million chunks in minutes: up to ``window``
    saves are in flight on the transfer's ``threads`` (POSIX engine, page cache); ``flush`` waits
    for them and raises when one was not published. A context manager (``close`` on exit)."""

    def __init__(self, ns: Namespace, threads: int = 8, window: int = 4096):
        self.ns = ns
        self._engine = PosixEngine(threads=1)
        self._transfer = PageTransfer(ns, self._engine, threads=threads, stats_flush_seconds=3600.0)
        self._window = window
        self._pending: list[Future[SaveStatus]] = []

    def write(self, group: int, key: bytes, parent: Optional[bytes], payload: bytes) -> str:
        """Queue the chunk of ``key`` (``payload``: a whole page of the group) and return its path,
        where the file is once ``flush`` returned."""
        page = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._pending.append(self._transfer.save_page(group, key, parent, [page]))
        if len(self._pending) >= self._window:
            self.flush()
        return self.ns.chunk_path(group, key)

    def flush(self) -> None:
        """Wait for every queued chunk; RuntimeError when one was dropped."""
        pending, self._pending = self._pending, []
        bad = [st for st in (f.result() for f in pending) if st not in (SaveStatus.PUBLISHED, SaveStatus.EXISTS)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(pending)} chunks not published ({bad[0]})")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._transfer.close()
            self._engine.close()

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def page_pool(num_pages: int, page_bytes: int, kind: str = "hugepage") -> torch.Tensor:
    """A page pool ``[num_pages, page_bytes]`` of ``kind`` (``POOLS``): ``torch`` is a plain
    ``torch.empty`` CPU tensor (64-byte aligned, 4 KiB pages: what engines hand over),
    ``hugepage`` 2 MiB-aligned host memory advised to use huge pages, ``pinned`` page-locked host
    memory and ``cuda`` device memory (both need CUDA: ``ValueError`` otherwise)."""
    if kind == "torch":
        return torch.empty((num_pages, page_bytes), dtype=torch.uint8)
    if kind == "hugepage":
        return torch.frombuffer(aligned_host_buffer(num_pages * page_bytes), dtype=torch.uint8).view(num_pages, page_bytes)
    if kind in ("pinned", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"a {kind} page pool needs CUDA")
        if kind == "pinned":
            return torch.empty((num_pages, page_bytes), dtype=torch.uint8, pin_memory=True)
        return torch.empty((num_pages, page_bytes), dtype=torch.uint8, device="cuda")
    raise ValueError(f"unknown page pool {kind!r} (one of {', '.join(POOLS)})")
