"""Store throughput against the two obvious alternatives, on one disk, in one run.

Called by ``gdskv bench`` (the CLI) and ``scripts/bench_store.py`` through ``main(argv)``;
``run(options)`` returns the report as a dict for callers that print it themselves.

Subjects, all moving pages of the same size and count between a page pool and one directory:

- ``ceiling``: the disk's ceiling, one file, ``O_DIRECT``, 4 MiB requests from 8 threads,
  page-aligned memory (the same at every page size);
- ``raw`` and ``raw+o_direct``: one file, pages written and read one after another at their
  offsets, through the page cache or with ``O_DIRECT`` (page-aligned memory);
- ``files``: one plain file per page (the store's count, sizes and directory fan-out), written
  and read buffered by Python threads at the store's depth, no checksum: ``warm/files`` in the
  report compares the store's warm loads with page-cache reads of files like its own;
- ``torch.save``: one ``.pt`` file per block (TensorRT-LLM's example KV cache connector);
- ``store:<engine>@<pool>``: the gdskv store through ``PageTransfer.save_pages`` / ``load_pages``
  (chunk files with trailers, checksums verified on load, temp-file + rename publish) in a fresh
  store whose chunk directories exist already (as in a store in service), per I/O engine label
  (``posix+o_direct`` is the default config) and per page pool: ``torch`` (plain ``torch.empty``
  CPU tensors, what engines hand over), ``hugepage`` (2 MiB-aligned host memory advised to use
  huge pages), ``pinned`` and ``cuda`` (where CUDA exists);
- ``service:host-tier@<pool>``: the store as a serving process runs it, through ``KvService`` with
  the default config (host tier on): saves write through into the tier, a cold load reads the
  disk and fills the tier, the hot load after it is served by the tier, and a warm load is served
  by the page cache (into host memory it leaves the tier alone);
- ``peer:vllm-fs-tier`` and ``peer:lmcache-disk``: vLLM's file-system offload tier and LMCache's
  local-disk backend, each driven in its own virtualenv (``gdskv.peers``), left out with the
  reason where that cannot be had.

The report also says what direct I/O the directory's file system asks (``statx``'s memory
alignment) and where each torch pool started past a page boundary, so whether the torch pools'
pages moved in place or through a staging copy: peers that read into page-aligned memory of
their own never pay that copy.

Each subject saves (timed until the bytes are durable: ``syncfs`` of the directory's file system,
for every subject alike; each round in a directory of its own, placed apart from the ones removed
before it: ``spread_directories``), loads cold (page cache of its files dropped with
``posix_fadvise(DONTNEED)``) and loads warm (its files read once through the page cache first:
a subject that reads the cache when the bytes are there shows it). ``load_hot`` (a host-memory
tier, filled by the cold load) is measured right after the cold load for subjects that have one
(``supports_hot``: the service subject), which forget those pages again before the warm load. Every timed
load goes into cleared pages and is checked after. Subjects are
interleaved within a round and the order rotates between rounds; each figure is the median over
rounds, because disks drift by tens of percent from one run to the next (and more on a machine
shared with other work). Once the subjects are set up, the heap is frozen (``gc.freeze``), as
vLLM's engine core does after start-up: a full collection triggered by a load's allocations then
walks what the run allocated since, not the ~190k objects of torch and the imports (a 70-130 ms
pause inside one of every few timed loads here, unfrozen).
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

import torch

from gdskv.bench_options import MAX_PAGE, MIN_PAGE, POOLS, BenchOptions, OneLineParser, parse_args  # noqa: F401
from gdskv.config import GdsKvConfig
from gdskv.hosttier import tier_bytes
from gdskv.io import batch as batchio
from gdskv.io import make_engine
from gdskv.io.base import IoEngine, Segment
from gdskv.io.posix import PosixEngine, aligned_host_buffer, move_all
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KINDS = ("save", "load_cold", "load_warm")
SAVE_TARGET = 0.85  # store save >= 0.85 x the best raw durable write (issue 13)
LOAD_TARGET = 0.9  # store cold load >= 0.9 x the disk's ceiling
PEER_TARGET = 1.1  # store cold load >= 1.1 x vLLM's file-system tier
WARM_TARGET = 1.0  # store warm load >= plain buffered reads of the same files
HOT_TARGET = 5.0  # a host-tier hit >= 5 x a cold load (subjects with a tier)


class _Subject:
    """One way of storing the pages. ``measure`` calls ``prepare`` with a fresh directory, then
    ``save``/``load`` (each returns once every byte has moved), then ``end_round``."""

    name: str
    pool: str = "hugepage"
    """The page pool ``measure`` hands this subject (``POOLS``); raw I/O needs aligned memory."""
    supports_hot = False
    """True for subjects with a host-memory tier (``ServiceSubject``): then ``load_hot`` is measured."""

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        self.workdir = workdir

    def clear(self, target: torch.Tensor) -> None:
        """Before each timed load: the target pages zeroed (and so already touched: a load's
        figure never includes first-touch page faults of its destination)."""
        target.zero_()

    def check(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """After each timed load: the pages read back equal the pages saved, or raise."""
        if not torch.equal(target, source):
            raise RuntimeError(f"{self.name}: pages read back differ from the pages saved")

    def hot_ready(self) -> bool:
        """After the cold load: whether host memory holds the pages, so ``load_hot`` can be timed
        (``supports_hot`` subjects)."""
        return True

    def load_hot(self, pages: torch.Tensor) -> None:
        """A load right after the cold load, served from host memory (``supports_hot`` subjects)."""
        self.load(pages)

    def forget_hot(self) -> None:
        """Before the cold and the warm load: host memory forgets the pages (``supports_hot``
        subjects), so those loads read the disk."""

    def save(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def load(self, pages: torch.Tensor) -> None:
        raise NotImplementedError

    def files(self) -> list[str]:
        raise NotImplementedError

    def end_round(self) -> None:
        """Release what ``prepare`` made beyond the files."""

    def close(self) -> None:
        """Release what the subject holds beyond its files (engines, threads)."""


class RawFile(_Subject):
    """One file, pages at their offsets: also the raw baseline of ``scripts/gpu_check.py``.

    ``direct``: written with ``O_DIRECT`` into a preallocated file and read with ``O_DIRECT``
    (the pools are huge-page-backed and aligned), else written and read through the page cache
    with the kernel's readahead. Both are measured because neither wins everywhere: direct I/O is
    the faster way to the device, the page cache the faster warm read; the yardstick of each kind
    is the better of the two.
    """

    def __init__(self, direct: bool = False):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.name = "raw+o_direct" if self.direct else "raw"

    def save(self, pages: torch.Tensor) -> None:
        path = self.files()[0]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        try:
            view = memoryview(pages.numpy()).cast("B")
            page_bytes = pages.shape[1]
            if self.direct:  # O_DIRECT growth without preallocation is slower
                os.posix_fallocate(fd, 0, pages.shape[0] * page_bytes)
            for off in range(0, pages.shape[0] * page_bytes, page_bytes):
                move_all(os.pwritev, fd, [view[off:off + page_bytes]], off)
        finally:
            os.close(fd)

    def load(self, pages: torch.Tensor) -> None:
        fd = os.open(self.files()[0], os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            view = memoryview(pages.numpy()).cast("B")
            page_bytes = pages.shape[1]
            for off in range(0, pages.shape[0] * page_bytes, page_bytes):
                if move_all(os.preadv, fd, [view[off:off + page_bytes]], off) != page_bytes:
                    raise OSError(f"{self.files()[0]}: short read at {off}")
        finally:
            os.close(fd)

    def files(self) -> list[str]:
        return [str(self.workdir / "pages.bin")]


class FilePerPage(_Subject):
    """One plain file per page, spread over directories as the store's chunks are, written and
    read by ``threads`` Python threads (the store's depth), buffered, without a checksum: the
    yardstick of the store's warm loads (page-cache reads of files like its own)."""

    name = "files"
    pool = "torch"

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads)

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        self._paths = [str(workdir / "c" / str(i % 64) / str(i)) for i in range(num_pages)]
        for i in range(min(64, num_pages)):
            os.makedirs(os.path.dirname(self._paths[i]), exist_ok=True)

    def _each(self, fn: Callable[[int], None], n: int) -> None:
        for _ in self._pool.map(fn, range(n)):
            pass

    def save(self, pages: torch.Tensor) -> None:
        def one(i: int) -> None:
            with open(self._paths[i], "wb", buffering=0) as f:
                f.write(memoryview(pages[i].numpy()))

        self._each(one, pages.shape[0])

    def load(self, pages: torch.Tensor) -> None:
        def one(i: int) -> None:
            with open(self._paths[i], "rb", buffering=0) as f:
                if f.readinto(memoryview(pages[i].numpy())) != pages.shape[1]:
                    raise OSError(f"{self._paths[i]}: short read")

        self._each(one, pages.shape[0])

    def files(self) -> list[str]:
        return self._paths

    def close(self) -> None:
        self._pool.shutdown()


class DiskCeiling(_Subject):
    """The disk's ceiling: every page's bytes in one preallocated file, moved with ``O_DIRECT``
    in 4 MiB requests by 8 threads, from page-aligned memory. What no store of many files can
    beat; the yardstick of the cold-load target."""

    name = "ceiling"
    REQUEST = 4 << 20
    THREADS = 8

    def _spans(self, pages: torch.Tensor) -> tuple[memoryview, list[int]]:
        view = memoryview(pages.numpy()).cast("B")
        return view, list(range(0, view.nbytes, self.REQUEST))

    def _run(self, pages: torch.Tensor, write: bool) -> None:
        view, starts = self._spans(pages)
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(self.files()[0], flags | os.O_DIRECT, 0o600)
        try:
            if write:
                os.posix_fallocate(fd, 0, view.nbytes)
            op = os.pwritev if write else os.preadv

            def one(start: int) -> None:
                span = view[start:start + self.REQUEST]
                if move_all(op, fd, [span], start) != span.nbytes:
                    raise OSError(f"{self.files()[0]}: short {'write' if write else 'read'} at {start}")

            with ThreadPoolExecutor(self.THREADS) as pool:
                list(pool.map(one, starts))
        finally:
            os.close(fd)

    def save(self, pages: torch.Tensor) -> None:
        self._run(pages, write=True)

    def load(self, pages: torch.Tensor) -> None:
        self._run(pages, write=False)

    def files(self) -> list[str]:
        return [str(self.workdir / "ceiling.bin")]


class _TorchSave(_Subject):
    name = "torch.save"
    pool = "torch"

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        self._paths: list[str] = []

    def save(self, pages: torch.Tensor) -> None:
        self._paths = [str(self.workdir / f"block{i}.pt") for i in range(pages.shape[0])]
        for i, path in enumerate(self._paths):
            torch.save(pages[i].clone(), path)  # a view would save the whole pool's storage

    def load(self, pages: torch.Tensor) -> None:
        for i, path in enumerate(self._paths):
            pages[i].copy_(torch.load(path))

    def files(self) -> list[str]:
        return self._paths


class StoreSubject(_Subject):
    """The gdskv store over one engine (which ``close`` closes), one fresh store per round. The
    pages may be on any device (``scripts/gpu_check.py`` measures CUDA page pools with it)."""

    def __init__(self, engine_label: str, engine: IoEngine, transfer_threads: int = 8, pool: str = "hugepage"):
        self.name = f"store:{engine_label}@{pool}"
        self.engine = engine
        self.transfer_threads = transfer_threads
        self.pool = pool

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        super().prepare(workdir, num_pages, page_bytes)
        spec = NamespaceSpec(model="gdskv-bench", dtype="uint8", tokens_per_block=1,
                             groups=(GroupSpec(0, page_bytes, (0,), None),))
        self.ns = PageStore.open(workdir / "store").namespace(spec)
        self.transfer = PageTransfer(self.ns, self.engine, threads=self.transfer_threads,
                                     stats_flush_seconds=3600.0)
        self.keys = [os.urandom(32) for _ in range(num_pages)]
        # A store in service made its chunk directories long ago (all 4096 of a group exist once
        # it holds some 30k chunks); making them is not the data path's cost, so the directories
        # this round's chunks go to are made before the clock starts.
        for key in self.keys:
            os.makedirs(os.path.dirname(self.ns.chunk_path(0, key)), exist_ok=True)

    def save(self, pages: torch.Tensor) -> None:
        futures = self.transfer.save_pages(0, [(key, None, [pages[i]]) for i, key in enumerate(self.keys)])
        _expect(self.name, futures, SaveStatus.PUBLISHED, "published")

    def load(self, pages: torch.Tensor) -> None:
        futures = self.transfer.load_pages(0, [(key, [pages[i]]) for i, key in enumerate(self.keys)])
        _expect(self.name, futures, LoadStatus.LOADED, "loaded")

    def files(self) -> list[str]:
        return [self.ns.chunk_path(0, key) for key in self.keys]

    def end_round(self) -> None:
        self.transfer.close()

    def close(self) -> None:
        self.engine.close()


class ServiceSubject(_Subject):
    """The store as a serving process runs it: ``KvService`` (what every connector holds) with
    the default config (``o_direct = "all"``, the host tier on), one fresh service and store per
    round. Saves are write-through into the host tier; the cold load reads the disk (the tier
    forgot the pages first), filling the tier's buffers in the pass that fills the pages; the hot
    load after it is served by the tier; the warm load (the tier forgot them again) is served by
    the page cache, and into host memory fills nothing. The tier's memory is touched in ``prepare``, as a serving
    process's has been long before (first-touch faults are not any load's cost)."""

    supports_hot = True

    def __init__(self, options: BenchOptions, pool: str = "torch"):
        self.name = f"service:host-tier@{pool}"
        self.pool = pool
        self.io_threads = options.io_threads

    def prepare(self, workdir: Path, num_pages: int, page_bytes: int) -> None:
        from gdskv.service import KvService  # the service imports more than the other subjects need

        super().prepare(workdir, num_pages, page_bytes)
        spec = NamespaceSpec(model="gdskv-bench", dtype="uint8", tokens_per_block=1,
                             groups=(GroupSpec(0, page_bytes, (0,), None),))
        need = num_pages * page_bytes
        cfg = GdsKvConfig(store_path=str(workdir / "store"), io_threads=self.io_threads, stats_flush_seconds=3600.0,
                          host_bytes=None if tier_bytes(None) >= need else need)
        self.svc = KvService(cfg, spec)
        self.keys = [os.urandom(32) for _ in range(num_pages)]
        for key in self.keys:  # as StoreSubject: a store in service has its chunk directories
            os.makedirs(os.path.dirname(self.svc.namespace.chunk_path(0, key)), exist_ok=True)
        slots = [self.svc.host.reserve(("warm-up", i), page_bytes) for i in range(num_pages)]
        for slot in filter(None, slots):
            slot.buf.zero_()
            self.svc.host.abort(slot)

    def _entries(self) -> list[tuple[int, int, bytes]]:
        return [(self.svc.spec.tp_rank, 0, key) for key in self.keys]

    def save(self, pages: torch.Tensor) -> None:
        futures = self.svc.save_many(0, [(key, None, [pages[i]]) for i, key in enumerate(self.keys)])
        _expect(self.name, futures, SaveStatus.PUBLISHED, "published")

    def load(self, pages: torch.Tensor) -> None:
        futures = self.svc.load_many(0, [(key, [pages[i]]) for i, key in enumerate(self.keys)])
        _expect(self.name, futures, LoadStatus.LOADED, "loaded")

    def hot_ready(self) -> bool:
        """Whether the cold load left every page in the host tier. It does not where the page
        cache served that load (a file system in memory, such as tmpfs, cannot drop its files),
        since a load the page cache serves leaves the tier alone."""
        return all(entry in self.svc.host for entry in self._entries())

    def load_hot(self, pages: torch.Tensor) -> None:
        before = self.svc.snapshot()["host_hits"]
        self.load(pages)
        if self.svc.snapshot()["host_hits"] - before != len(self.keys):
            raise RuntimeError(f"{self.name}: the hot load was not served from the host tier")

    def forget_hot(self) -> None:
        for entry in self._entries():
            self.svc.host.discard(entry)

    def files(self) -> list[str]:
        return [self.svc.namespace.chunk_path(0, key) for key in self.keys]

    def end_round(self) -> None:
        self.svc.close()


def _expect(name: str, futures: Sequence[Future], wanted: Any, what: str) -> None:
    """Wait for a subject's page futures; raise unless every one came back ``wanted``."""
    bad = [status for status in (f.result() for f in futures) if status is not wanted]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} pages not {what} ({bad[0]})")


def bench_engine(label: str, options: BenchOptions, store_path: str) -> IoEngine:
    """The engine of a bench label, as ``make_engine`` builds it from a config: ``<engine>``
    (``o_direct = "off"``), ``<engine>+o_direct`` (``"all"``, the default config),
    ``<engine>+direct_writes`` (``"writes"``), for the engines ``posix`` and ``kvikio``. kvikio's
    settings are process-wide, so a run takes one kvikio label at most. Called by ``run`` and
    ``scripts/gpu_check.py``."""
    name, _, flag = label.partition("+")
    o_direct = {"": "off", "o_direct": "all", "direct_writes": "writes"}.get(flag)
    if o_direct is None:
        raise ValueError(f"unknown engine label {label!r}")
    cfg = GdsKvConfig(store_path=store_path, engine=name, io_threads=options.io_threads,
                      o_direct=o_direct, kvikio_threads=options.kvikio_threads,
                      kvikio_task_size=options.kvikio_task_size)
    return make_engine(cfg)


def engine_usable(label: str, options: BenchOptions, directory: str) -> Optional[str]:
    """None when the engine of ``label`` can move a page in ``directory``; otherwise why not (e.g.
    kvikio without libcuda). Called by ``run`` and ``scripts/gpu_check.py`` before they build it."""
    try:
        engine = bench_engine(label, options, directory)
    except Exception as exc:  # not installed, bad config: report and leave the engine out
        return str(exc)
    probe = os.path.join(directory, f".probe-{label}")
    try:
        engine.write(probe, [Segment(0, torch.zeros(4096, dtype=torch.uint8))]).result()
        engine.read(probe, [Segment(0, torch.zeros(4096, dtype=torch.uint8))]).result()
        return None
    except OSError as exc:
        return str(exc)
    finally:
        engine.close()
        if os.path.exists(probe):
            os.unlink(probe)


# --- the page cache and durability ------------------------------------------------------------
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


# --- the run ----------------------------------------------------------------------------------
def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(subject: _Subject, source: torch.Tensor, target: torch.Tensor, base: Path,
            shape: Optional[tuple[int, int]] = None) -> dict[str, float]:
    """Seconds, by kind, of one save of the pages of ``source`` (``[num_pages, page_bytes]``) up
    to ``syncfs``, one load into ``target`` with the page cache dropped and one warm load
    (files read through the page cache first), each into pages the subject cleared before and
    checks after, outside the timing, in a fresh directory under ``base`` removed afterwards.
    Called per subject and round by ``run``. ``shape``: pages and page size, for
    subjects that hold their own pages (then ``source`` and ``target`` are empty)."""
    workdir = Path(tempfile.mkdtemp(prefix="round-", dir=base))
    subject.prepare(workdir, *(shape or source.shape))
    try:
        sync_directory_fs(workdir)  # earlier dirty pages are not this save's cost
        secs = {"save": _timed(lambda: (subject.save(source), sync_directory_fs(workdir)))}
        files = subject.files()
        hot = getattr(subject, "supports_hot", False)
        drop_page_cache(files)
        if hot:
            subject.forget_hot()
        subject.clear(target)
        secs["load_cold"] = _timed(lambda: subject.load(target))
        subject.check(source, target)
        if hot and subject.hot_ready():
            subject.clear(target)
            secs["load_hot"] = _timed(lambda: subject.load_hot(target))
            subject.check(source, target)
        fill_page_cache(files)
        if hot:
            subject.forget_hot()
        subject.clear(target)
        secs["load_warm"] = _timed(lambda: subject.load(target))
        subject.check(source, target)
        return secs
    finally:
        subject.end_round()
        shutil.rmtree(workdir)


def rates(nbytes: int, secs: dict[str, float]) -> str:
    """``save 1.23, load_cold 1.50, load_warm 6.01 GB/s`` for ``nbytes`` moved in ``secs``."""
    return ", ".join(f"{k} {nbytes / v / 1e9:.2f}" for k, v in secs.items()) + " GB/s"


def _measure_page_size(page_bytes: int, subjects: list[Any], options: BenchOptions, base: Path,
                       log: Callable[[str], None], skipped: dict[str, str],
                       torch_offsets: dict[int, int]) -> dict[str, dict[str, list[float]]]:
    """Every round of every subject at one page size. A peer whose driver dies is taken out of
    ``subjects`` (for the later page sizes too), with the reason in ``skipped``. Where the torch
    pool that pages load into starts past a page boundary goes into ``torch_offsets``."""
    from gdskv.peers import PeerUnavailable

    num_pages = max(1, options.total_bytes // page_bytes)
    data = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(page_bytes))
    pools: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind in {s.pool for s in subjects}:
        if kind == "own":  # a peer's driver holds its own pages
            pools[kind] = (torch.empty(num_pages, 0, dtype=torch.uint8),) * 2
            continue
        source, target = page_pool(num_pages, page_bytes, kind), page_pool(num_pages, page_bytes, kind)
        source.copy_(data)
        pools[kind] = (source, target)
        if kind == "torch":
            torch_offsets[page_bytes] = target.data_ptr() % 4096
    del data
    samples: dict[str, dict[str, list[float]]] = {s.name: {} for s in subjects}
    for rnd in range(options.rounds if subjects else 0):  # every subject may have been left out
        order = subjects[rnd % len(subjects):] + subjects[:rnd % len(subjects)]
        for subject in order:
            if subject not in subjects:
                continue  # its driver died earlier in this round
            try:
                secs = measure(subject, *pools[subject.pool], base, (num_pages, page_bytes))
            except PeerUnavailable as exc:  # a peer's driver died: the others' figures still count
                log(f"  {_size(page_bytes)} pages: {exc}; left out from here on")
                skipped[f"{subject.name} from {_size(page_bytes)} pages on"] = str(exc)
                subjects.remove(subject)
                subject.close()
                continue
            for kind, v in secs.items():
                samples[subject.name].setdefault(kind, []).append(v)
            log(f"  {_size(page_bytes)} pages, round {rnd + 1}/{options.rounds}, {subject.name}: "
                + rates(num_pages * page_bytes, secs))
    for subject in subjects:
        if getattr(subject, "supports_hot", False) and samples[subject.name] and "load_hot" not in samples[subject.name]:
            skipped[f"{subject.name} hot loads at {_size(page_bytes)} pages"] = (
                "its cold loads were served by the page cache, which leaves the host tier alone (a file system "
                "in memory, such as tmpfs, cannot drop its files): point --dir at a disk")
    return {name: s for name, s in samples.items() if s}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


def _subjects(options: BenchOptions, base: Path, report: dict[str, Any], log: Callable[[str], None]) -> list[Any]:
    """Every subject the options ask for; the ones that cannot run here are left out, with the
    reason in ``report["skipped"]``."""
    from gdskv.peers import PeerSubject, PeerUnavailable

    subjects: list[Any] = ([DiskCeiling(), RawFile(), RawFile(direct=True), FilePerPage(options.transfer_threads), _TorchSave()]
                           if options.baselines else [])
    for pool in options.pools:
        try:
            page_pool(1, 4096, pool)
        except ValueError as exc:
            report["skipped"][f"pool {pool}"] = str(exc)
            continue
        for label in options.engines:
            why = engine_usable(label, options, str(base))
            if why is None:
                subjects.append(StoreSubject(label, bench_engine(label, options, str(base)), options.transfer_threads, pool))
            else:
                report["skipped"][f"store:{label}"] = why
        if options.service:
            subjects.append(ServiceSubject(options, pool))
    for key in options.peers:
        try:
            subjects.append(PeerSubject(key, log))
        except PeerUnavailable as exc:
            report["skipped"][f"peer {key}"] = str(exc)
    for what, why in report["skipped"].items():
        log(f"{what} left out: {why}")
    return subjects


TERMINATED_STATUS = 128 + signal.SIGTERM
"""The exit status of a bench stopped by SIGTERM (the shell's convention)."""


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within it, from the main thread, SIGTERM (a job manager, ``timeout``, ``kill``) raises
    ``SystemExit(TERMINATED_STATUS)`` as Ctrl-C raises ``KeyboardInterrupt``: the benchmark
    unwinds through its cleanup (temporary directories, peer drivers, servers) instead of dying
    with them left behind. Used by ``run`` and by the benchmark scripts' ``__main__``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> NoReturn:
        raise SystemExit(TERMINATED_STATUS)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(options: BenchOptions, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure every subject at every page size; the report as a JSON-ready dict. Stopped by
    SIGTERM, it removes what it made and raises ``SystemExit(TERMINATED_STATUS)``."""
    with sigterm_as_exit():
        return _run(options, log)


def _run(options: BenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="gdskv-bench-", dir=options.directory))
    report: dict[str, Any] = {"options": {k: (list(v) if isinstance(v, tuple) else v)
                                          for k, v in vars(options).items()},
                              "skipped": {}, "results": []}
    if sum(label.startswith("kvikio") for label in options.engines) > 1:
        raise ValueError("gdskv bench: --engines takes one kvikio label at most (its settings are process-wide)")
    subjects: list[Any] = []
    try:
        report["direct_io"] = _direct_io(base)
        report["spread_directories"] = spread_directories(base)
        subjects = _subjects(options, base, report, log)
        gc.collect()
        gc.freeze()
        for page_bytes in options.page_sizes:
            samples = _measure_page_size(page_bytes, subjects, options, base, log, report["skipped"],
                                         report["direct_io"]["torch_pool_offsets"])
            moved = max(1, options.total_bytes // page_bytes) * page_bytes
            for name, s in samples.items():
                row: dict[str, Any] = {"page_bytes": page_bytes, "subject": name, "bytes": moved}
                for kind, v in s.items():
                    row[f"{kind}_gbps"] = moved / statistics.median(v) / 1e9
                    row[f"{kind}_gbps_rounds"] = [moved / t / 1e9 for t in v]
                report["results"].append(row)
            _add_ratios(report, page_bytes)
    finally:
        gc.unfreeze()
        for subject in subjects:
            subject.close()
        shutil.rmtree(base, ignore_errors=True)
    return report


def _direct_io(base: Path) -> dict[str, Any]:
    """The memory alignment at which the native path moves pages in place on the file system
    under ``base`` (``batchio.dio_alignment``; None where the kernel does not say; 0 where it
    takes no direct I/O); ``_measure_page_size`` adds where each torch pool started past a page
    boundary (``torch_pool_offsets``, by page size)."""
    probe = base / "direct-io-probe"
    probe.write_bytes(b"\0")
    try:
        dio = batchio.dio_alignment(str(probe))
    finally:
        probe.unlink()
    return {"memory_align": None if dio is None else (dio.in_place if dio.offset else 0), "torch_pool_offsets": {}}


def _add_ratios(report: dict[str, Any], page_bytes: int) -> None:
    """Store rows get ``vs_ceiling`` (cold load), ``vs_vllm`` (cold load, where the vLLM tier
    ran), ``vs_raw`` (per kind, against the better of ``raw`` and ``raw+o_direct``: for saves,
    the raw durable write) and ``meets_target`` (save >= SAVE_TARGET x raw, cold >= LOAD_TARGET x
    ceiling, and >= PEER_TARGET x vLLM where it ran, warm >= WARM_TARGET x ``files``, hot >=
    HOT_TARGET x cold where the subject has a host tier)."""
    rows = {r["subject"]: r for r in report["results"] if r["page_bytes"] == page_bytes}
    raws = [row for name, row in rows.items() if name.startswith("raw")]
    ceiling, vllm, files = rows.get("ceiling"), rows.get("peer:vllm-fs-tier"), rows.get("files")
    for name, row in rows.items():
        if not name.startswith(("store:", "service:")):
            continue
        if row.get("load_hot_gbps"):
            row["hot_vs_cold"] = row["load_hot_gbps"] / row["load_cold_gbps"]
        met = [row["hot_vs_cold"] >= HOT_TARGET] if "hot_vs_cold" in row else []
        if raws:
            row["vs_raw"] = {k: row[f"{k}_gbps"] / max(r[f"{k}_gbps"] for r in raws) for k in KINDS}
            met.append(row["vs_raw"]["save"] >= SAVE_TARGET)
        if files:
            row["warm_vs_files"] = row["load_warm_gbps"] / files["load_warm_gbps"]
            met.append(row["warm_vs_files"] >= WARM_TARGET)
        if ceiling:
            row["vs_ceiling"] = row["load_cold_gbps"] / ceiling["load_cold_gbps"]
            met.append(row["vs_ceiling"] >= LOAD_TARGET)
        if vllm:
            row["vs_vllm"] = row["load_cold_gbps"] / vllm["load_cold_gbps"]
            met.append(row["vs_vllm"] >= PEER_TARGET)
        if met:
            row["meets_target"] = all(met)


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: GB/s per subject and page size, then the store's ratios."""
    lines = [f"{'page':>5} {'subject':<30} {'save':>6} {'cold':>6} {'warm':>6} {'hot':>6}   "
             f"{'cold/ceil':>9} {'cold/vllm':>9} {'save/raw':>8} {'warm/raw':>8} {'warm/files':>10} {'hot/cold':>8}  target"]

    def fmt(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    for row in report["results"]:
        raw = row.get("vs_raw") or {}
        met = row.get("meets_target")
        lines.append(
            f"{_size(row['page_bytes']):>5} {row['subject']:<30} {row['save_gbps']:>6.2f} {row['load_cold_gbps']:>6.2f} "
            f"{row['load_warm_gbps']:>6.2f} {fmt(row.get('load_hot_gbps')):>6}   {fmt(row.get('vs_ceiling')):>9} "
            f"{fmt(row.get('vs_vllm')):>9} {fmt(raw.get('save')):>8} {fmt(raw.get('load_warm')):>8} "
            f"{fmt(row.get('warm_vs_files')):>10} {fmt(row.get('hot_vs_cold')):>8}  "
            f"{'' if met is None else ('met' if met else 'MISSED')}")
    for what, why in report["skipped"].items():
        lines.append(f"{what} left out: {why}")
    opts = report["options"]
    dio = report.get("direct_io")
    if dio:
        align, offsets = dio["memory_align"], dio["torch_pool_offsets"]
        if align == 0:
            lines.append("direct I/O: none on this file system (chunks go through the page cache)")
        else:
            rule = align or batchio.ALIGN  # what the native path assumes where the kernel does not say
            said = f"{align}-byte-aligned memory moves in place" if align else "alignment not reported (4 KiB assumed)"
            pools = ", ".join(f"{_size(int(page))} pages +{off} B ({'in place' if off % rule == 0 else 'staged'})"
                              for page, off in offsets.items())
            lines.append(f"direct I/O: {said}" + (f"; the torch pools started past a page boundary by: {pools}" if pools else ""))
    if report.get("spread_directories") is False:
        lines.append("round directories: not spread over the disk (no chattr +T here): on ext4 without a journal, a "
                     "one-file-per-page save can pay for the files the round before it removed")
    lines.append(f"GB/s = 1e9 bytes/s; medians of {opts['rounds']} rounds of {opts['total_bytes'] >> 20} MiB; save "
                 f"includes syncfs; cold = page cache dropped; warm = files in the page cache; targets: cold >= "
                 f"{LOAD_TARGET} x ceiling and >= {PEER_TARGET} x vLLM's tier, save >= {SAVE_TARGET} x the best raw "
                 f"durable write, warm >= {WARM_TARGET} x files, hot >= {HOT_TARGET} x cold; warm/raw compares with "
                 f"the better raw warm read (a page-cache copy), warm/files with plain buffered reads of one file per "
                 f"page (the same count and sizes) at the store's depth")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``gdskv bench`` and ``scripts/bench_store.py``; returns the exit status."""
    options, as_json = parse_args(argv)
    report = run(options, log=(lambda line: print(line, file=sys.stderr)))
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
