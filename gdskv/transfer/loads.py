"""Loads: a chunk file read straight into a page slot and verified before it counts.

The load half of ``PageTransfer`` (``gdskv.transfer.core``): ``load_page``/``load_pages`` for
the service and the connector workers, the per-page path (``_load``) and the native batch path
(``_load_native``: open, read and checksum with the GIL released). The trailer, the keys and
the payload checksum are verified before a page reports LOADED; anything else is a miss
(MISSING) or, for a chunk that fails a check, CORRUPT: counted and quarantined. Never an error
in the serving loop.
"""
from __future__ import annotations

import errno
import logging
import time
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch

from gdskv import checksum
from gdskv import format as fmt
from gdskv.confined import NotRegularFileError, OutsideStoreError, dir_path, touch_mtime
from gdskv.copies import gather
from gdskv.io import batch as batchio
from gdskv.io.base import Segment, ShortReadError
from gdskv.transfer.batches import FOREGROUND_CALLERS, NATIVE_CALLERS
from gdskv.transfer.pages import DoneFn, LoadStatus, LoadVia, as_list, file_segments

log = logging.getLogger(__name__)


class LoadPath:
    """The load methods of ``PageTransfer``, which holds their state (``gdskv.transfer.core``)."""

    def load_page(self, group: int, key: bytes, segments: Sequence[torch.Tensor],
                  ready: Optional[Any] = None) -> "Future[LoadStatus]":
        """Read the chunk of ``key`` into the page's segments and verify it.

        ``ready``: something with ``synchronize()`` (a CUDA event recorded on the engine's stream
        when it handed the slot over) that the transfer thread waits on before any byte of the
        slot is written, so kernels still using the slot's previous contents finish first. When
        the future resolves, the bytes are in the slot (device copies included): the engine may
        launch work that reads them. Unless the result is LOADED, the segments' contents are
        undefined and must not be used. A list of segments stays unchanged until then too.
        """
        return self.load_pages(group, [(key, segments)], ready)[0]

    def load_pages(self, group: int, items: Sequence[tuple], ready: Optional[Any] = None,
                   on_done: Optional[DoneFn] = None, background: bool = False) -> list["Future[LoadStatus]"]:
        """``load_page`` for a step's pages at once (``(key, segments)`` each, one ``ready`` for
        all): one future per page, in order, with at most ``depth`` pages in flight (see
        ``_batch``, and there for ``on_done``). An item ``(key, segments, via)`` names a
        ``LoadVia`` whose buffer holds the payload too once the page is LOADED (unless it asks
        for disk reads only and the page cache served the chunk): on the native path each cache-sized step
        of the chunk, once read (into the staging buffer, or the page itself where aligned), is
        checksummed and copied into the page and into ``via`` while in cache, so keeping the
        page costs no second pass over it. (Reading straight into ``via`` instead measured
        slower here: a fresh, large buffer per load, against a small staging buffer reused.)
        ``background``: no forward pass waits for these pages (an asynchronous load): they move
        on the background threads."""
        jobs = [(item[0], as_list(item[1]), item[2] if len(item) > 2 else None) for item in items]
        if background and ready is None and jobs and self._later_ready() and not self._any_staged(jobs, 1):
            return self._later(group, jobs, on_done, save=False)
        return self._batch(self._load, self._load_slice, group, jobs, ready, on_done,
                           *((self._background, NATIVE_CALLERS) if background else (self._pool, FOREGROUND_CALLERS)))

    def _load(self, group: int, key: bytes, segments: list[torch.Tensor], via: Optional[LoadVia] = None) -> LoadStatus:
        """One page on the per-page path; a LOADED page's payload is copied into ``via`` too."""
        status = self._load_page(group, key, segments)
        if status is LoadStatus.LOADED and via is not None:
            gather(segments, via.buf)
            via.copied = True
        return status

    def _load_page(self, group: int, key: bytes, segments: list[torch.Tensor]) -> LoadStatus:
        ns = self.ns
        path = ns.chunk_path(group, key)
        nbytes = sum(s.numel() for s in segments)
        trailer = bytearray(fmt.TRAILER_BYTES)
        staged = self._staged(segments)
        targets = segments if staged is None else staged
        segs = file_segments(targets, trailer)
        budget = ns.store.budget
        if budget is not None:
            budget.pin(path)
        try:
            reason = self._read_and_verify(group, key, nbytes, segs, trailer, targets)
            if reason is None and staged is not None:
                for page, host in zip(segments, staged):
                    page.reshape(-1).view(torch.uint8).copy_(host)
        except FileNotFoundError:
            ns.counters.add("loads_missing")
            return LoadStatus.MISSING
        except OutsideStoreError as e:
            ns.counters.add("loads_refused")
            self._warn("refused", f"gdskv: load of {path} refused: {e}")
            return LoadStatus.MISSING
        except OSError as e:
            self._warn("load", f"gdskv: load of {path} failed: {e}{self._store_state()}")
            ns.counters.add("loads_io_error")
            return LoadStatus.MISSING
        except Exception as e:  # never into the serving loop: a bug here is a miss, logged
            log.exception("gdskv: load of %s failed unexpectedly: %s", path, e)
            ns.counters.add("loads_error")
            return LoadStatus.MISSING
        finally:
            if budget is not None:
                budget.unpin(path)
            self._maybe_flush()
        if reason is not None:
            ns.counters.add("loads_corrupt")
            ns.quarantine(group, path, reason)
            return LoadStatus.CORRUPT
        ns.counters.add("loads_hit")
        ns.counters.add("bytes_read", nbytes)
        return LoadStatus.LOADED

    def _load_slice(self, group: int, jobs: list[tuple[bytes, list[torch.Tensor], Optional[LoadVia]]],
                    threads: int = 1) -> list[LoadStatus]:
        """``_load`` for a slice of pages through the native batch path (``_load_native``), its
        pages to stage read into ``SliceStaging`` first (``_through_staging``)."""
        staged = self._through_staging(group, jobs, threads, save=False)
        return staged if staged is not None else self._load_native(group, jobs, threads)

    def _load_native(self, group: int, jobs: list[tuple[bytes, list[torch.Tensor], Optional[LoadVia]]],
                     threads: int = 1) -> list[LoadStatus]:
        """``_load`` for a slice of pages in host memory: one call opens, reads
        and checksums every chunk with the GIL released, on ``threads`` native threads (a page
        with a ``via`` buffer gets a copy of its payload there, in the same pass) and, without an
        auth key, verifies each trailer against what this page's must say
        (``batchio.expectation``); a trailer it did not verify is checked here. A page the batch
        path cannot take, or that fails in it (missing, short, corrupt, refused), goes through
        ``_load``, which classifies and counts it."""
        out: list[Optional[LoadStatus]] = [None] * len(jobs)
        reads, rest = self._prepare_reads(group, jobs)
        for i in rest:
            out[i] = self._load(group, *jobs[i])
        if reads.work:
            try:
                results = self.engine.read_chunks_now(self.ns.store.fs.fd, reads.work, threads)
            except BaseException:
                self._unpin(reads)
                raise
            for i in self._settle_reads(group, jobs, reads, results, out):
                out[i] = self._load(group, *jobs[i])
        self._maybe_flush()
        return out  # type: ignore[return-value]

    def _prepare_reads(self, group: int, jobs: Sequence[tuple[bytes, list[torch.Tensor], Optional[LoadVia]]]
                       ) -> tuple["Reads", list[int]]:
        """The native read jobs of the pages the batch path can take (their chunks pinned against
        eviction until ``_settle_reads``), and the indices of those it cannot."""
        ns = self.ns
        budget = ns.store.budget
        reads = Reads()
        rest: list[int] = []
        for i, (key, segments, via) in enumerate(jobs):
            trailer = bytearray(fmt.TRAILER_BYTES)
            pieces = batchio.pieces_of(segments, trailer)
            if pieces is None:
                rest.append(i)
                continue
            through = None
            nbytes = sum(n for _, n in pieces[:-1])
            if via is not None and via.buf.numel() == nbytes:
                through = [(via.buf.data_ptr(), nbytes)]
            expect = None if self._auth_key is not None or len(key) not in (8, 32) else \
                batchio.expectation(group, nbytes, ns.store_key(group, key), key)
            reads.work.append((ns.chunk_relpath(group, key), pieces, through, expect,
                               through is not None and not via.cached))
            reads.trailers.append(trailer)
            reads.sizes.append(nbytes)
            reads.native.append(i)
            if through is None and via is not None:
                reads.copy_to_via.add(i)
            if budget is not None:
                reads.pinned.append(ns.chunk_path(group, key))
                budget.pin(reads.pinned[-1])
        return reads, rest

    def _unpin(self, reads: "Reads") -> None:
        budget = self.ns.store.budget
        for path in reads.pinned:
            budget.unpin(path)
        reads.pinned = []

    def _settle_reads(self, group: int, jobs: Sequence[tuple[bytes, list[torch.Tensor], Optional[LoadVia]]],
                      reads: "Reads", results: Sequence[batchio.ReadResult], out: list[Optional[LoadStatus]]) -> list[int]:
        """After the native reads of ``_prepare_reads``: unpin their chunks, verify what the
        native side did not, set ``out[i]`` LOADED for each page that holds its KV now and count
        them; the indices of the pages that failed there (for ``_load`` to classify)."""
        ns = self.ns
        self._unpin(reads)
        failed: list[int] = []
        loaded = nbytes_loaded = 0
        for i, trailer, nbytes, result in zip(reads.native, reads.trailers, reads.sizes, results):
            key, segments, via = jobs[i]
            if result.err == 0 and (result.verified or checksum.check_crc(
                    trailer, segments, result.crc, group=group, store_key=ns.store_key(group, key), block_key=key,
                    nbytes=nbytes, auth_key=self._auth_key) is None):
                loaded += 1
                nbytes_loaded += nbytes
                out[i] = LoadStatus.LOADED
                if i in reads.copy_to_via:
                    gather(segments, via.buf)
                    via.copied = True
                elif via is not None:
                    via.copied = result.copied
            else:
                failed.append(i)
        if loaded:
            ns.counters.add("loads_hit", loaded)
            ns.counters.add("bytes_read", nbytes_loaded)
        return failed

    def _read_and_verify(self, group: int, key: bytes, nbytes: int, segs: list[Segment], trailer: bytearray,
                         segments: list[torch.Tensor]) -> Optional[str]:
        """Read the chunk through its confined directory and verify it: None when it is this
        key's page (its recency is then refreshed), else the quarantine reason. A chunk that
        is momentarily absent is looked for once more: eviction renames a chunk aside before it
        decides, and puts it back when a lease vetoes (``gdskv.eviction``)."""
        rel_dir, name = self.ns.chunk_location(group, key)
        fs = self.ns.store.fs
        for attempt in (0, 1):
            try:
                with fs.directory(rel_dir) as dfd:
                    try:
                        self.engine.read_now(dir_path(dfd, name), segs)
                    except ShortReadError:
                        return "truncated"
                    except NotRegularFileError:
                        return "not-a-file"
                    except OSError as e:
                        if e.errno == errno.ELOOP:
                            return "link"
                        if e.errno in (errno.ENXIO, errno.EISDIR):
                            return "not-a-file"
                        raise
                    reason = self._verify(group, key, nbytes, bytes(trailer), segments)
                    if reason is None:
                        try:
                            touch_mtime(name, dfd)
                        except OSError:
                            pass
                    return reason
            except FileNotFoundError:
                if attempt:
                    raise
                time.sleep(0.002)
        raise AssertionError("unreachable")

    def _verify(self, group: int, key: bytes, nbytes: int, raw: bytes, segments: list[torch.Tensor]) -> Optional[str]:
        """None when the chunk is exactly this key's page; otherwise the reason it is not."""
        return checksum.check(raw, segments, group=group, store_key=self.ns.store_key(group, key), block_key=key,
                              nbytes=nbytes, auth_key=self._auth_key)


class Reads:
    """The native read jobs of a slice of load jobs (``PageTransfer._prepare_reads``): per
    native page its index among the jobs, its job, trailer buffer and payload size; the chunks
    pinned meanwhile; the pages whose ``via`` copy is made after verification."""

    __slots__ = ("native", "work", "trailers", "sizes", "pinned", "copy_to_via")

    def __init__(self) -> None:
        self.native: list[int] = []
        self.work: list[tuple] = []
        self.trailers: list[bytearray] = []
        self.sizes: list[int] = []
        self.pinned: list[str] = []
        self.copy_to_via: set[int] = set()
