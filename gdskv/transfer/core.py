"""``PageTransfer``: page slot ⇄ chunk file for one namespace, the only code that moves page bytes
in and out of the store.

The class holds the state (the namespace, the I/O engine, the thread pools, the saves on their
way, the native completions) and runs batches over the pools (``_batch``) and through host
staging (``_through_staging``); its saves are in ``gdskv.transfer.saves``, its loads in
``gdskv.transfer.loads``, and the transfers the serving loop finishes in
``gdskv.transfer.later``. One ``PageTransfer`` per namespace, made by ``KvService`` (and the
demo, the benchmarks and the TensorRT-LLM worker).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import torch

from gdskv.futures import batch_futures, resolve_many
from gdskv.copies import gather_all, scatter_all
from gdskv.io.base import IoEngine
from gdskv.io.posix import staging_buffer
from gdskv.staging import SliceStaging, region_views
from gdskv.store import Namespace
from gdskv.transfer.batches import SLICE_PAGES, bookkeep, started_pool
from gdskv.transfer.later import LaterPath
from gdskv.transfer.lineage import SavesOnTheirWay
from gdskv.transfer.loads import LoadPath
from gdskv.transfer.pages import DoneFn, LoadStatus
from gdskv.transfer.saves import SavePath

log = logging.getLogger(__name__)


class PageTransfer(SavePath, LoadPath, LaterPath):
    """Asynchronous page saves and loads for one namespace over one I/O engine."""

    def __init__(self, namespace: Namespace, engine: IoEngine, threads: int = 8, stats_flush_seconds: float = 5.0,
                 checksum: Optional[int] = None, auth_key: Optional[bytes] = None, stage_host: Optional[bool] = None,
                 background_nice: int = 0):
        """``checksum``: the payload checksum algorithm for saves (``gdskv.format.CHECKSUM_*``);
        None picks by where the page lives (``gdskv.checksum.seal``). ``auth_key``: the config's
        chunk key (``GdsKvConfig.auth_key()``): saves carry a MAC, loads require one.
        ``stage_host``: move pages through a host buffer of the transfer thread (None: exactly
        when a page is in device memory and the engine has no GDS, so it would bounce the page
        through host memory anyway): on the native path a slice's pages share one buffer
        (``SliceStaging``), on the per-page path each thread has one. A staged page is
        checksummed on the host copy (CRC32C: no device work, no device scratch memory), and a
        staged load reaches the page only once verified. ``background_nice``: how much nicer
        than the caller's thread the threads of saves and of loads posted with
        ``background=True`` run (``gdskv.priority``); 0: one pool for everything, at the caller's
        priority."""
        self.ns = namespace
        self._checksum = checksum
        self._auth_key = auth_key
        self._stage_host = stage_host
        self._staging = threading.local()
        self._slice_staging = SliceStaging()
        self.engine = engine
        self.depth = threads
        self._pool = started_pool(threads, "gdskv-xfer", 0)
        self._background = started_pool(threads, "gdskv-xfer-bg", background_nice) if background_nice > 0 else self._pool
        self._flush_every = stats_flush_seconds
        self._last_flush = time.monotonic()
        self._warned: dict[str, float] = {}
        self._warn_lock = threading.Lock()
        self._tmp_seq = itertools.count()  # temp names unique within the process, no syscall
        self._background_nice = background_nice
        self._completions: Optional[Any] = None  # native transfers finished by ``reap`` (``_later``)
        self._reaper: Optional[threading.Thread] = None
        self._later_lock = threading.Lock()
        self._closed = False
        self._saving = SavesOnTheirWay()  # what a budget is told about a save's parent

    def _batch(self, fn: Callable[..., Any], slice_fn: Callable[[int, list[tuple], int], list[Any]], group: int,
               jobs: list[tuple], ready: Optional[Any], on_done: Optional[DoneFn], pool: ThreadPoolExecutor,
               callers: int) -> list[Future]:
        """Run the jobs with ``depth`` pages in flight on ``pool``. Each pool thread waits on
        ``ready`` once, then takes slices of jobs until none is left and resolves their futures
        itself: a batch costs a few hand-offs, not one per page (the per-page submit, wake-up and
        future of the pool were a fifth of a warm 64 KiB load). Where the native batch path applies
        (``gdskv.io.batch``), at most ``callers`` pool threads (``NATIVE_CALLERS`` or
        ``FOREGROUND_CALLERS``) each pass slices of up to
        ``SLICE_PAGES`` pages to ``slice_fn(group, jobs, inner)``, which moves them on ``inner``
        native threads without the GIL (``callers * inner`` <= ``depth``): Python threads
        contending for the GIL were what slowed both the pages and the serving thread.
        Otherwise ``depth`` pool threads run ``fn(group, *job)`` per page. Pages complete in any
        order; a cancelled future's page is skipped. ``on_done(done, results, skipped)`` runs on
        the worker once per slice, before that slice's futures resolve: the indices of the jobs
        it ran, their results (None when the slice raised) and the indices of the cancelled jobs
        it skipped. The caller's per-page bookkeeping (``KvService``'s counters and host-tier
        fills) happens there, a slice at a time, and whoever sees a page done sees it done."""
        futures = batch_futures(len(jobs))
        native = self._batchable()
        if native:
            threads = min(callers, self.depth, len(jobs))
            inner = max(1, self.depth // max(1, threads))
            size = max(1, min(SLICE_PAGES, -(-len(jobs) // (max(1, threads) * 2))))
        else:
            threads, inner, size = min(self.depth, len(jobs)), 1, 1
        slices = iter(range(0, len(jobs), size))  # next() on a range iterator is atomic under the GIL

        def worker() -> None:
            if ready is not None:
                ready.synchronize()
            for start in slices:
                span = range(start, min(start + size, len(jobs)))
                picked = [i for i in span if futures[i].set_running_or_notify_cancel()]
                error: Optional[BaseException] = None
                try:
                    if native:
                        results = slice_fn(group, [jobs[i] for i in picked], inner)
                    else:
                        results = [fn(group, *jobs[i]) for i in picked]
                except BaseException as e:  # noqa: BLE001 - delivered through the pages' futures
                    results, error = None, e
                bookkeep(on_done, picked, results,
                          [i for i in span if i not in picked] if len(picked) < len(span) else [])
                resolve_many([futures[i] for i in picked], results, error)

        for _ in range(threads):
            pool.submit(worker)
        return futures

    def _batchable(self) -> bool:
        """Whether slices may go to the native batch path: an engine that batches chunks (the
        POSIX engine with the extension built and working; kvikio moves device memory itself)."""
        return self.engine.batches_chunks

    def _staged(self, segments: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """Host views, one per segment, of this thread's staging buffer when the page is to be
        staged (see ``stage_host``); None otherwise. The buffer is pinned where CUDA is present
        and huge-page aligned otherwise (O_DIRECT moves it in place), grown to the page."""
        if not self._stages(segments):
            return None
        sizes = [s.numel() * s.element_size() for s in segments]
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < sum(sizes):
            buf = self._staging.buf = staging_buffer(sum(sizes))
        return region_views(buf, sizes)

    def _stages(self, segments: Sequence[torch.Tensor]) -> bool:
        """Whether a page moves through a host buffer (see ``stage_host``)."""
        if self._stage_host is not None:
            return self._stage_host
        return not self.engine.gds_active and not all(s.is_cpu for s in segments)

    def _any_staged(self, jobs: Sequence[tuple], at: int) -> bool:
        """Whether a page of ``jobs`` (its regions at ``at`` in each) moves through a host buffer:
        such a batch goes to ``_batch``, whose slices stage it, not to ``_later``. Asked of every
        step: a 4096-page step of host pages costs a fraction of a millisecond."""
        if self._stage_host is not None:
            return self._stage_host and bool(jobs)
        return not self.engine.gds_active and not all(t.is_cpu for job in jobs for t in job[at])

    def _through_staging(self, group: int, jobs: Sequence[tuple], threads: int, save: bool) -> Optional[list[Any]]:
        """A slice holding pages to stage (``_stages``, regions contiguous), a span at a time
        through ``SliceStaging``: a save's staged pages are copied into the span's buffer (one
        wait per device) and written from there natively; a load's are read and verified there
        natively, and only the LOADED ones copied out into their pages (one wait per device), so
        a bad chunk never reaches a page. None when the slice holds no page to stage."""
        at = 2 if save else 1
        if not self._any_staged(jobs, at):
            return None
        staged = [self._stages(job[at]) and all(t.is_contiguous() for t in job[at]) for job in jobs]
        if not any(staged):
            return None
        sizes = [sum(t.numel() * t.element_size() for t in job[at]) if st else 0 for job, st in zip(jobs, staged)]
        out: list[Any] = []
        for span in self._slice_staging.spans(sizes):
            sub = [jobs[i] for i in span]
            with self._slice_staging.carved([jobs[i][at] if staged[i] else None for i in span]) as carved:
                host_jobs = [job if c is None else (*job[:at], c[1], *job[at + 1:]) for job, c in zip(sub, carved)]
                if save:
                    gather_all([(c[0], job[at]) for job, c in zip(sub, carved) if c is not None])
                    out += self._save_native(group, host_jobs, threads)
                else:
                    results = self._load_native(group, host_jobs, threads)
                    scatter_all([(c[0], job[at]) for job, c, r in zip(sub, carved, results)
                                 if c is not None and r is LoadStatus.LOADED], threads)
                    out += results
        return out

    def _store_state(self) -> str:
        """A note for log lines when the store's directory itself was removed under this process."""
        return "" if self.ns.store.fs.alive else " (the store directory was removed; restart to use a new one)"

    def _warn(self, kind: str, msg: str) -> None:
        """Log at most once every 10 s per kind: a full disk must not flood the serving log."""
        now = time.monotonic()
        with self._warn_lock:
            if now - self._warned.get(kind, -1e9) < 10:
                return
            self._warned[kind] = now
        log.warning(msg)

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self._flush_every:
            self._last_flush = now
            self.ns.store.flush_stats()

    def close(self) -> None:
        """Wait for in-flight transfers and persist counters. The engine is closed by its owner."""
        with self._later_lock:
            self._closed = True
        if self._completions is not None:
            self._completions.close()
            self._reaper.join()
            while not self._completions.wait_idle(1.0):
                pass
            self.reap()
        self._pool.shutdown(wait=True)
        self._background.shutdown(wait=True)
        self.ns.store.flush_stats()
