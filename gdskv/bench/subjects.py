"""The bench's subjects: the store and the service as gdskv runs them, and the baselines beside them.

Each subject saves and loads the same pages (``measure`` in ``gdskv.bench.rounds``); the peers'
subjects are in ``gdskv.peers``.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from gdskv.bench.options import BenchOptions
from gdskv.config import GdsKvConfig
from gdskv.hosttier import tier_bytes
from gdskv.io import make_engine
from gdskv.io.base import IoEngine, Segment
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus


class Subject:
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


class StoreSubject(Subject):
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


class ServiceSubject(Subject):
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
