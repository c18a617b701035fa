"""Transfers finished by the serving loop: saves and asynchronous loads started on native threads.

The ``_later`` part of ``PageTransfer`` (``gdskv.transfer.core``): a step's saves, and the pages
of an asynchronous load, start on native threads without the interpreter and are finished
(verified, counted, their futures resolved) by ``reap`` on the serving loop's thread between
steps, or by the reaper thread for what the loop leaves uncollected.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from gdskv.futures import batch_futures, resolve_many
from gdskv.io import batch as batchio
from gdskv.transfer.batches import NATIVE_CALLERS, bookkeep, writer_threads
from gdskv.transfer.loads import Reads
from gdskv.transfer.pages import DoneFn, LoadStatus

log = logging.getLogger(__name__)

REAP_GRACE = 0.05
"""Seconds a transfer finished natively waits for the serving loop to collect it
(``PageTransfer.reap`` between steps) before the reaper thread does: long enough that between
steps of a busy engine the serving thread collects every one, so no Python thread takes the
interpreter from it."""


class LaterPath:
    """The ``_later`` methods of ``PageTransfer``, which holds their state (``gdskv.transfer.core``)."""

    def _later_ready(self) -> bool:
        """Whether transfers can go through ``_later`` (the native path, not closed: after
        ``close`` they go to the pools, which refuse them)."""
        if self._completions is None and self._batchable():
            with self._later_lock:
                if self._completions is None and not self._closed:
                    self._completions = batchio.completions()
                    self._reaper = threading.Thread(target=self._reap_overdue, name="gdskv-xfer-reap", daemon=True)
                    self._reaper.start()
        return self._completions is not None and not self._closed and self._batchable()

    def _later(self, group: int, jobs: list[tuple], on_done: Optional[DoneFn], save: bool) -> list[Future]:
        """Saves, or an asynchronous load's pages, started on native threads (niced by
        ``background_nice``; for saves, as many as their bytes call for: ``writer_threads``) and
        returned from at once: the pages' futures resolve, and
        ``on_done`` runs, in the ``reap`` that collects them, on the serving loop's thread
        between steps, so no Python thread competes with it for the interpreter while the pages
        move (a saved page is sealed natively too). Pages the batch path cannot take, saves the
        budget admits only after an eviction, and pages that fail in it, are redone on the
        background pool. A caller blocked on one of the futures hurries the reaper
        (``_hurried``)."""
        futures = batch_futures(len(jobs), self._hurried)
        for fut in futures:
            fut.set_running_or_notify_cancel()
        out: list[Any] = [None] * len(jobs)
        if save:
            native, work, rest, trailers = self._prepare_saves(group, jobs, out, serving=True)
            reads = None
        else:
            reads, rest = self._prepare_reads(group, jobs)
            native, work, trailers = reads.native, reads.work, reads.trailers
        if work:
            later = _Later(group, jobs, native, reads, trailers, futures, on_done)
            fd, threads = self.ns.store.fs.fd, max(1, self.depth // NATIVE_CALLERS)
            try:
                if save:
                    threads = writer_threads(len(work) * self.ns.chunk_nbytes(group), threads)
                    self.engine.write_chunks_later(self._completions, fd, work, threads, self.ns.store.fs.dir_mode,
                                                   self._background_nice, later)
                else:
                    self.engine.read_chunks_later(self._completions, fd, work, threads, self._background_nice, later)
            except Exception as e:  # never into the serving loop: these pages go the per-page way
                log.warning("gdskv: %d page %s could not start natively (redone one by one): %s", len(work),
                            "saves" if save else "loads", e)
                if reads is not None:
                    self._unpin(reads)
                self._background.submit(self._redo, group, jobs, native, futures, on_done, save, True)
        now = [i for i, status in enumerate(out) if status is not None]
        if now:  # saves already stored or refused by the budget
            bookkeep(on_done, now, [out[i] for i in now])
            resolve_many([futures[i] for i in now], [out[i] for i in now], None)
        if rest:
            self._background.submit(self._redo, group, jobs, sorted(rest), futures, on_done, save)
        return futures

    def copy_later(self, copies: list[tuple[int, int, int]], on_done: Callable[[], None]) -> Optional[Future]:
        """Host-memory copies ``(dst, src, length)`` (memory the caller keeps as it is until the
        future resolves) started on native threads niced by ``background_nice``, as ``_later``
        starts an asynchronous load: ``on_done`` runs and the returned future resolves
        ``LOADED`` in the ``reap`` that collects them. ``KvService.load_many`` serves an
        asynchronous load's host-tier hits this way. None where there is no native path (kvikio,
        closed) or it cannot start: the caller copies them its own way."""
        if not copies or not self._later_ready():
            return None
        fut = batch_futures(1, self._hurried)[0]
        fut.set_running_or_notify_cancel()
        try:
            self.engine.copy_later(self._completions, copies, max(1, self.depth // NATIVE_CALLERS),
                                   self._background_nice, _Copies(fut, on_done))
        except Exception as e:
            log.warning("gdskv: %d host-memory copies could not start natively: %s", len(copies), e)
            return None
        return fut

    def reap(self) -> None:
        """Finish the transfers of ``_later`` that completed since the last call: verify and
        count their pages, run their ``on_done`` and resolve their futures (and so their
        callbacks) on this thread. Called by the serving loop between steps (``KvService.reap``)
        and by this transfer's reaper thread for what the serving loop left uncollected for
        ``REAP_GRACE`` seconds (it does not call, or its steps are long) or someone waits for."""
        if self._completions is None:
            return
        for later, results in self.engine.collect_done(self._completions):
            if isinstance(later, _Copies):
                later.finish()
                continue
            out: list[Any] = [None] * len(later.jobs)
            try:
                if later.reads is None:
                    failed = self._settle_saves(later.group, later.jobs, later.native, results, out)
                else:
                    failed = self._settle_reads(later.group, later.jobs, later.reads, results, out)
            except Exception:  # never lose the pages' futures: they are redone one by one
                log.exception("gdskv: settling transfers finished natively failed")
                failed = [i for i in later.native if out[i] is None]
            done = [i for i in later.native if out[i] is not None]
            bookkeep(later.on_done, done, [out[i] for i in done])
            resolve_many([later.futures[i] for i in done], [out[i] for i in done], None)
            if failed:
                self._background.submit(self._redo, later.group, later.jobs, failed, later.futures, later.on_done,
                                        later.reads is None, True)
        self._maybe_flush()

    @contextlib.contextmanager
    def _hurried(self) -> Iterator[None]:
        """While a caller blocks on a future of ``_later``: the reaper thread collects every
        finished transfer at once rather than leaving it to the serving loop."""
        self._completions.hurry(1)
        try:
            yield
        finally:
            self._completions.hurry(-1)

    def _reap_overdue(self) -> None:
        """The reaper thread: waits without the interpreter until a finished transfer has gone
        uncollected for ``REAP_GRACE`` seconds (or someone waits for one), then reaps; exits at
        ``close``."""
        completions = self._completions
        while not self._closed:
            if completions.wait_overdue(REAP_GRACE, 3600.0):
                self.reap()

    def _redo(self, group: int, jobs: Sequence[tuple], idx: list[int], futures: list[Future],
              on_done: Optional[DoneFn], save: bool, admitted: bool = False) -> None:
        """Pages of ``_later`` on the per-page path (the background pool), which classifies and
        counts each; ``admitted``: saves whose native write failed after the budget admitted them."""
        if save:
            fn = self._save_failed if admitted else self._save
        else:
            fn = self._load
        error: Optional[BaseException] = None
        try:
            results: Optional[list[Any]] = [fn(group, *jobs[i]) for i in idx]
        except BaseException as e:  # noqa: BLE001 - delivered through the pages' futures, as ``_batch`` does
            results, error = None, e
        bookkeep(on_done, idx, results)
        resolve_many([futures[i] for i in idx], results, error)


class _Later(NamedTuple):
    """Native transfers in flight (``PageTransfer._later``), handed back by ``collect_done``:
    the indices of the native jobs among ``jobs``; ``reads`` for loads, None for saves."""

    group: int
    jobs: list[tuple]
    native: list[int]
    reads: Optional[Reads]
    trailers: list[bytearray]  # the jobs' last pieces point into them
    futures: list[Future]
    on_done: Optional[DoneFn]


class _Copies(NamedTuple):
    """Host-memory copies in flight (``PageTransfer.copy_later``)."""

    future: Future
    on_done: Callable[[], None]

    def finish(self) -> None:
        """Run ``on_done`` (a failure is logged: the bytes are in place), then resolve."""
        try:
            self.on_done()
        except Exception:
            log.exception("gdskv: finishing host-memory copies failed")
        resolve_many([self.future], [LoadStatus.LOADED], None)
