"""Page slot ⇄ chunk file: the only code that moves page bytes in and out of the store.

``save_page`` writes a page to a temporary file beside its chunk, with a trailer carrying the
payload checksum and the full keys, then renames it into place: a reader sees a whole chunk or
none. ``load_page`` reads the payload straight into the page slot and the trailer beside it, and
verifies the trailer, the keys and the payload checksum before it reports LOADED. Anything else
is a miss (MISSING) or, for a chunk that fails a check, CORRUPT: counted and quarantined.

Both return futures and never raise I/O errors to the caller: a full disk, a vanished store or a
bad chunk degrades to recomputation with a log line and a counter.

Called by the connector workers (TensorRT-LLM: ``start_load_kv`` / ``save_kv_layer``; MAX:
``load`` / ``offload``), the demo and the benchmarks. One ``PageTransfer`` per namespace.
"""
from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from gdskv import checksum
from gdskv import format as fmt
from gdskv.confined import NotRegularFileError, OutsideStoreError, dir_path, touch_mtime
from gdskv.futures import batch_futures, resolve_many
from gdskv.hosttier import gather, gather_all, scatter_all
from gdskv.io import batch as batchio
from gdskv.io.base import Buffer, IoEngine, Segment, ShortReadError, tensor_bytes
from gdskv.io.posix import staging_buffer
from gdskv.priority import lower_this_thread
from gdskv.staging import SliceStaging, region_views
from gdskv.store import Namespace

log = logging.getLogger(__name__)

SLICE_PAGES = 64
"""Most pages one native batch call moves (``PageTransfer._batch``): enough to amortize the call
and its GIL round trip, few enough that a step's pages still spread over the callers."""
NATIVE_CALLERS = 2
"""Pool threads that pass slices of saves and asynchronous loads to the native batch path at once,
the depth shared among them: two, so that one verifies and resolves its slice (with the GIL)
while the other's pages move (without it). Work that runs beside the serving thread: more
callers are more Python threads taking the GIL from it (``scripts/bench_ttft.py``'s decode steps
with saves at 64 MiB/s / as fast as they go, medians of 5 runs: 1.04 / 1.06x the steps without
at 2 callers, 1.06 / 1.09x at 4)."""
FOREGROUND_CALLERS = 4
"""The same for loads a forward pass waits for, where only their pace counts: while one caller
verifies its slice and its native threads wait for the slowest page of the call, the others'
pages keep the device busy. Cold 256 KiB loads, same files, alternated in one process on the
2-vCPU VM (depth 16): 2 callers of 8 threads 3.01 / 2.72 GB/s (two runs), 4 of 4 3.35 / 3.07
(+11-13%, faster in every round), 8 of 2 3.08, 16 of 1 3.02; at 1 MiB 3.23 vs 3.33, at 4 MiB
equal (the disk's pace)."""


REAP_GRACE = 0.05
"""Seconds a transfer finished natively waits for the serving loop to collect it
(``PageTransfer.reap`` between steps) before the reaper thread does: long enough that between
steps of a busy engine the serving thread collects every one, so no Python thread takes the
interpreter from it."""

DoneFn = Callable[[list[int], Optional[list[Any]], list[int]], None]
"""``on_done(done, results, skipped)`` of ``save_pages``/``load_pages``: see ``PageTransfer._batch``."""


class SaveStatus(enum.Enum):
    PUBLISHED = "published"
    EXISTS = "exists"
    DROPPED = "dropped"


class LoadStatus(enum.Enum):
    LOADED = "loaded"
    MISSING = "missing"
    CORRUPT = "corrupt"


class LoadVia:
    """A load's second destination (``load_pages``): ``buf``, a flat ``uint8`` host buffer of the
    page's size (the host tier's, ``KvService.load_many``), gets the payload too. ``cached``:
    also when the page cache serves the chunk; when False, the native path leaves ``buf`` alone
    for such a chunk. ``copied`` is set before the batch's ``on_done`` runs: whether ``buf``
    holds the payload of a LOADED page."""

    __slots__ = ("buf", "cached", "copied")

    def __init__(self, buf: torch.Tensor, cached: bool = True) -> None:
        self.buf = buf
        self.cached = cached
        self.copied = False


def page_segments(group_layout: Any, slot: int) -> list[torch.Tensor]:
    """The byte tensors of page slot ``slot`` of a layer group, region by region.

    ``slot_tensor`` raises ``IndexError`` outside the pool, so ``-1`` can never alias a page.
    """
    return [r.slot_tensor(slot) for r in group_layout.regions]


class PageTransfer:
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
        self._pool = _started_pool(threads, "gdskv-xfer", 0)
        self._background = _started_pool(threads, "gdskv-xfer-bg", background_nice) if background_nice > 0 else self._pool
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
        # per layer group, key -> [parent, copies posted and not finished, copies of them the
        # budget refused] of every save on its way: what ``_lineage`` tells the budget about a
        # parent (two requests of a step may post the same block)
        self._saving: dict[int, dict[bytes, list]] = {}
        self._saving_lock = threading.Lock()

    # --- saves --------------------------------------------------------------------------------
    def save_page(self, group: int, key: bytes, parent: Optional[bytes], segments: Sequence[torch.Tensor],
                  ready: Optional[Any] = None) -> "Future[SaveStatus]":
        """Publish a page under ``key`` (in layer group ``group``) unless it is already stored.

        ``ready``: something with ``synchronize()`` (a CUDA event recorded on the forward pass's
        stream) that the transfer thread waits on before it reads the page, so the caller never
        blocks on the device. The caller keeps the page's memory, and a list of its segments,
        unchanged until the future resolves.
        """
        return self.save_pages(group, [(key, parent, segments)], ready)[0]

    def save_pages(self, group: int, items: Sequence[tuple], ready: Optional[Any] = None,
                   on_done: Optional[DoneFn] = None) -> list["Future[SaveStatus]"]:
        """``save_page`` for a step's pages at once (``(key, parent, segments)`` each, one
        ``ready`` for all): one future per page, in order, with at most ``depth`` pages in flight
        (see ``_batch``, and there for ``on_done``), on the background threads; without a
        ``ready`` on the native path, started on native threads and finished by ``reap`` (see
        ``_later``), which seal the pages too. An item ``(key, parent, segments, via)`` names a
        flat ``uint8`` host buffer of the page's size (the host tier's, ``KvService.save_many``)
        that holds the payload too once the page is PUBLISHED: the native path copies it there
        in the pass that seals the page (one read of the page for both)."""
        jobs = [(item[0], item[1], _as_list(item[2]), item[3] if len(item) > 3 else None) for item in items]
        on_done = self._posted(group, jobs, on_done)
        if ready is None and jobs and self._later_ready() and not self._any_staged(jobs, 2):
            return self._later(group, jobs, on_done, save=True)
        return self._batch(self._save, self._save_slice, group, jobs, ready, on_done, self._background, NATIVE_CALLERS)

    def _posted(self, group: int, jobs: list[tuple], on_done: Optional[DoneFn]) -> Optional[DoneFn]:
        """Note a step's saves as on their way (``_saving``) until they finish, where a budget
        may evict for them: the returned ``on_done``, which every path runs for every page before
        its future resolves, forgets them, then runs the caller's."""
        if self.ns.store.budget is None:
            return on_done
        with self._saving_lock:
            saving = self._saving.setdefault(group, {})
            for job in jobs:
                entry = saving.setdefault(job[0], [job[1], 0, 0])
                entry[1] += 1

        def finished(done: list[int], results: Optional[list[Any]], skipped: list[int]) -> None:
            with self._saving_lock:
                for i, k in enumerate(done):
                    _forget(saving, jobs[k][0], results[i] is SaveStatus.DROPPED if results else True)
                for k in skipped:
                    _forget(saving, jobs[k][0], False)
            if on_done is not None:
                on_done(done, results, skipped)

        return finished

    def _admit(self, budget: Any, group: int, nbytes: int, parent: Optional[bytes]) -> bool:
        """``Budget.admit`` for a save of a chunk of ``nbytes`` under ``parent``, which asks the
        chain's ``_lineage`` once it may evict, not before it waited."""
        return budget.admit(self.ns, group, nbytes, lineage=lambda: self._lineage(group, parent))

    def _lineage(self, group: int, parent: Optional[bytes]) -> tuple[Optional[bytes], list[bytes]]:
        """``(stored, saving)`` for a save's ``Budget.admit``: the parent and its ancestors that
        saves of this transfer are still writing (nearest first), and the block above them,
        which must be stored already. A step's chain on a full store then evicts for every
        block, not only the ones whose parent had landed."""
        saving: list[bytes] = []
        with self._saving_lock:
            posted = self._saving.get(group, {})
            while parent is not None and len(saving) <= len(posted):
                entry = posted.get(parent)
                if entry is None or entry[1] <= entry[2]:
                    break  # not posted, or every copy of it refused
                saving.append(parent)
                parent = entry[0]
        return parent, saving

    def _save(self, group: int, key: bytes, parent: Optional[bytes], segments: list[torch.Tensor],
              via: Optional[torch.Tensor] = None) -> SaveStatus:
        """One page on the per-page path; a PUBLISHED page's payload is copied into ``via`` too
        (``ValueError`` before anything is written when ``via`` is not the page's size)."""
        if via is not None:
            nbytes = sum(t.numel() * t.element_size() for t in segments)
            if via.numel() * via.element_size() != nbytes:
                raise ValueError(f"a via buffer of {via.numel() * via.element_size()} bytes for a page of {nbytes}")
        status = self._save_page(group, key, parent, segments)
        if status is SaveStatus.PUBLISHED and via is not None:
            gather(segments, via)
        return status

    def _save_page(self, group: int, key: bytes, parent: Optional[bytes], segments: list[torch.Tensor]) -> SaveStatus:
        ns = self.ns
        path = ns.chunk_path(group, key)
        nbytes = sum(s.numel() for s in segments)
        expected = ns.spec.group(group).bytes_per_page
        if nbytes != expected:
            raise ValueError(f"layer group {group}: page is {nbytes} bytes, namespace expects {expected}")
        try:
            return self._save_checked(group, key, parent, segments, path, nbytes)
        except Exception as e:  # never into the serving loop: a bug here is a dropped save, logged
            log.exception("gdskv: save of %s failed unexpectedly: %s", path, e)
            ns.counters.add("saves_dropped")
            ns.counters.add("saves_error")
            return SaveStatus.DROPPED

    def _save_checked(self, group: int, key: bytes, parent: Optional[bytes], segments: list[torch.Tensor], path: str,
                      nbytes: int) -> SaveStatus:
        ns = self.ns
        if ns.contains_many(group, [key])[0]:
            ns.counters.add("saves_exists")
            return SaveStatus.EXISTS
        budget = ns.store.budget
        if budget is not None and not self._admit(budget, group, nbytes + fmt.TRAILER_BYTES, parent):
            return self._refused(group, key)
        return self._save_admitted(group, key, parent, segments, path, nbytes)

    def _refused(self, group: int, key: bytes) -> SaveStatus:
        """A save the budget refused: counted, and this copy no longer on its way (``_saving``)
        from now, not only once its slice is done, so that a child later in the slice is not
        admitted, and evicted for, as if its parent would land."""
        self.ns.counters.add("saves_dropped")
        self.ns.counters.add("saves_dropped_budget")
        with self._saving_lock:
            entry = self._saving.get(group, {}).get(key)
            if entry is not None:
                entry[2] += 1
        return SaveStatus.DROPPED

    def _save_admitted(self, group: int, key: bytes, parent: Optional[bytes], segments: list[torch.Tensor], path: str,
                       nbytes: int) -> SaveStatus:
        """Seal, write and publish a page the budget admitted (``_save_checked``; ``_save_slice``
        for a page its native write could not publish)."""
        ns = self.ns
        budget = ns.store.budget
        staged = self._staged(segments)
        if staged is not None:
            for host, page in zip(staged, segments):
                host.copy_(page.reshape(-1).view(torch.uint8))
            segments = staged
        trailer = checksum.seal(segments, group=group, store_key=ns.store_key(group, key), block_key=key, parent_key=parent,
                                algo=self._checksum, auth_key=self._auth_key)
        segs = _file_segments(segments, trailer)
        try:
            self._write_and_publish(group, key, segs)
        except OSError as e:
            ns.counters.add("saves_dropped")
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                ns.counters.add("saves_dropped_disk_full")
            self._warn("save", f"gdskv: save of a page to {path} dropped: {e}{self._store_state()}")
            return SaveStatus.DROPPED
        finally:
            self._maybe_flush()
        ns.counters.add("saves_published")
        ns.counters.add("bytes_written", nbytes)
        if budget is not None:
            budget.on_published(ns, group, key, parent, nbytes + fmt.TRAILER_BYTES)
        return SaveStatus.PUBLISHED

    def _write_and_publish(self, group: int, key: bytes, segs: list[Segment]) -> None:
        """Write a temp file beside the chunk and rename it into place, inside the chunk's
        directory opened through ``store.fs`` (no link on the way, nothing outside the store).
        The directory is made only when it is missing (a store in service has it: no syscalls
        spent per save). Something that is not a file where the chunk belongs (a directory) is
        quarantined and the rename tried once more."""
        rel_dir, name = self.ns.chunk_location(group, key)
        fs = self.ns.store.fs
        for attempt in (0, 1):
            try:
                with fs.directory(rel_dir, create=attempt == 1) as dfd:
                    tmp = f"{name}{fmt.TMP_MARK}{os.getpid()}.{next(self._tmp_seq):x}"
                    try:
                        self.engine.write_now(dir_path(dfd, tmp), segs)
                        try:
                            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                        except (IsADirectoryError, NotADirectoryError, OSError) as e:
                            if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                                raise
                            self.ns.quarantine(group, fs.abspath(f"{rel_dir}/{name}"), "not-a-file")
                            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    except BaseException:
                        _unlink_quietly(tmp, dfd)
                        raise
                return
            except FileNotFoundError:
                if attempt:
                    raise

    def _save_slice(self, group: int, jobs: list[tuple], threads: int = 1) -> list[SaveStatus]:
        """``_save`` for a slice of pages through the native batch path (``_save_native``), its
        pages to stage through ``SliceStaging`` first (``_through_staging``)."""
        staged = self._through_staging(group, jobs, threads, save=True)
        return staged if staged is not None else self._save_native(group, jobs, threads)

    def _save_native(self, group: int, jobs: list[tuple], threads: int = 1) -> list[SaveStatus]:
        """``_save`` for a slice of pages in host memory: checks and admission in
        Python, then one call seals, writes and publishes every chunk with the GIL released, on
        ``threads`` native threads. A page the batch path cannot take, or that fails in it,
        goes through ``_save``."""
        out: list[Optional[SaveStatus]] = [None] * len(jobs)
        native, work, rest, trailers = self._prepare_saves(group, jobs, out)
        for i in rest:
            out[i] = self._save(group, *jobs[i])
        if work:
            errs = self.engine.write_chunks_now(self.ns.store.fs.fd, work, threads, self.ns.store.fs.dir_mode)
            del trailers  # the pieces pointed into them until here
            for i in self._settle_saves(group, jobs, native, errs, out):
                out[i] = self._save_failed(group, *jobs[i])
        self._maybe_flush()
        return out  # type: ignore[return-value]

    def _prepare_saves(self, group: int, jobs: Sequence[tuple], out: list[Optional[SaveStatus]],
                       serving: bool = False) -> tuple[list[int], list[tuple], list[int], list[bytearray]]:
        """Sort a slice of saves (``(key, parent, segments, via)`` each): ``out[i]`` set for
        pages already stored (EXISTS) or refused by the budget (DROPPED); the native write jobs of
        the rest, their trailers packed end to end in one buffer with zero checksums for the
        native side to seal (``fmt.pack_unsealed_into``, ``gdskv.io.batch.write_chunks``), or
        sealed here where an auth key asks for a MAC, and their ``via`` buffers as the payload's
        copy-out; the indices of the native jobs and of the pages the batch path cannot take (for
        ``_save``); that buffer (in a list), which must outlive the writes. ``serving``: called on
        the serving loop's thread (``_later``), where a page the budget cannot take without
        evicting goes to ``_save`` on a transfer thread too (``Budget.admit_now``, once for the
        slice), and the native writer looks for a stored chunk itself (``ERR_PRESENT``), so this
        thread makes no system call per page."""
        ns = self.ns
        expected = ns.spec.group(group).bytes_per_page
        chunk_bytes = ns.chunk_nbytes(group)
        look_later = serving and not ns.holds_unusable
        present = [False] * len(jobs) if look_later else ns.contains_many(group, [job[0] for job in jobs])
        present_size = (chunk_bytes,) if look_later else ()
        budget = ns.store.budget
        native: list[int] = []
        work: list[tuple] = []
        rest: list[int] = []
        block = bytearray(fmt.TRAILER_BYTES * max(1, len(jobs)))  # the native jobs' trailers, end to end
        base = batchio.address_of(block)
        admissible: list[int] = []
        for i, (key, parent, segments, via) in enumerate(jobs):
            if sum(t.numel() * t.element_size() for t in segments) != expected or \
                    (via is not None and via.numel() * via.element_size() != expected):
                rest.append(i)  # ``_save`` raises the size error per page
            elif present[i]:
                ns.counters.add("saves_exists")
                out[i] = SaveStatus.EXISTS
            elif not batchio.host_pages(segments) or self._checksum not in (None, fmt.CHECKSUM_CRC32C):
                rest.append(i)
            else:
                admissible.append(i)
        if budget is not None and serving and admissible:
            admitted = budget.admit_now(chunk_bytes, len(admissible))
            rest += admissible[admitted:]  # room takes an eviction: ``_save`` on a transfer thread makes it
            admissible = admissible[:admitted]
        for i in admissible:
            key, parent, segments, via = jobs[i]
            if budget is not None and not serving and not self._admit(budget, group, chunk_bytes, parent):
                out[i] = self._refused(group, key)
                continue
            skey = ns.store_key(group, key)
            at = fmt.TRAILER_BYTES * len(native)
            if self._auth_key is not None:
                block[at:at + fmt.TRAILER_BYTES] = checksum.seal(segments, group=group, store_key=skey, block_key=key,
                                                                 parent_key=parent, algo=fmt.CHECKSUM_CRC32C,
                                                                 auth_key=self._auth_key)
            else:
                fmt.pack_unsealed_into(block, at, group, expected, skey, key, parent)
            rel_dir, name = ns.chunk_location(group, key)
            tmp = f"{name}{fmt.TMP_MARK}{os.getpid()}.{next(self._tmp_seq):x}"
            outs = None if via is None else [(via.data_ptr(), via.numel())]
            work.append((rel_dir, tmp, name, batchio.pieces_at(segments, base + at), self._auth_key is None, outs,
                         *present_size))
            native.append(i)
        return native, work, rest, [block]

    def _settle_saves(self, group: int, jobs: Sequence[tuple], native: list[int], errs: Sequence[int],
                      out: list[Optional[SaveStatus]]) -> list[int]:
        """After the native writes of ``_prepare_saves``: ``out[i]`` PUBLISHED for each page whose
        chunk is in place, counted and told to the budget, EXISTS for each the writer found
        stored already; the indices of those that failed there (a full disk, something in the
        way: for ``_save_failed``)."""
        ns = self.ns
        budget = ns.store.budget
        expected = ns.spec.group(group).bytes_per_page
        chunk_bytes = ns.chunk_nbytes(group)
        failed: list[int] = []
        published: list[tuple[bytes, Optional[bytes]]] = []
        for i, err in zip(native, errs):
            if err == batchio.ERR_PRESENT:
                ns.counters.add("saves_exists")
                out[i] = SaveStatus.EXISTS
                if budget is not None:
                    budget.on_present(chunk_bytes)
                continue
            if err:
                failed.append(i)
                continue
            published.append(jobs[i][:2])
            out[i] = SaveStatus.PUBLISHED
        if published:
            if budget is not None:
                budget.on_published_many(ns, group, published, chunk_bytes)
            ns.counters.add("saves_published", len(published))
            ns.counters.add("bytes_written", len(published) * expected)
        return failed

    def _save_failed(self, group: int, key: bytes, parent: Optional[bytes], segments: list[torch.Tensor],
                     via: Optional[torch.Tensor] = None) -> SaveStatus:
        """A page the budget admitted whose native write failed, on the per-page path, which
        classifies the failure (and retries what was in the way); copied into ``via`` once
        PUBLISHED, as ``_save`` does."""
        status = self._save_admitted(group, key, parent, segments, self.ns.chunk_path(group, key),
                                     self.ns.spec.group(group).bytes_per_page)
        if status is SaveStatus.PUBLISHED and via is not None:
            gather(segments, via)
        return status

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

    # --- loads --------------------------------------------------------------------------------
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
        jobs = [(item[0], _as_list(item[1]), item[2] if len(item) > 2 else None) for item in items]
        if background and ready is None and jobs and self._later_ready() and not self._any_staged(jobs, 1):
            return self._later(group, jobs, on_done, save=False)
        return self._batch(self._load, self._load_slice, group, jobs, ready, on_done,
                           *((self._background, NATIVE_CALLERS) if background else (self._pool, FOREGROUND_CALLERS)))

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
                _bookkeep(on_done, picked, results,
                          [i for i in span if i not in picked] if len(picked) < len(span) else [])
                resolve_many([futures[i] for i in picked], results, error)

        for _ in range(threads):
            pool.submit(worker)
        return futures

    def _batchable(self) -> bool:
        """Whether slices may go to the native batch path: an engine that batches chunks (the
        POSIX engine with the extension built and working; kvikio moves device memory itself)."""
        return self.engine.batches_chunks

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
        segs = _file_segments(targets, trailer)
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
                       ) -> tuple["_Reads", list[int]]:
        """The native read jobs of the pages the batch path can take (their chunks pinned against
        eviction until ``_settle_reads``), and the indices of those it cannot."""
        ns = self.ns
        budget = ns.store.budget
        reads = _Reads()
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

    def _unpin(self, reads: "_Reads") -> None:
        budget = self.ns.store.budget
        for path in reads.pinned:
            budget.unpin(path)
        reads.pinned = []

    def _settle_reads(self, group: int, jobs: Sequence[tuple[bytes, list[torch.Tensor], Optional[LoadVia]]],
                      reads: "_Reads", results: Sequence[batchio.ReadResult], out: list[Optional[LoadStatus]]) -> list[int]:
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

    # --- transfers finished by the serving loop -----------------------------------------------
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
        ``background_nice``) and returned from at once: the pages' futures resolve, and
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
            _bookkeep(on_done, now, [out[i] for i in now])
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
            _bookkeep(later.on_done, done, [out[i] for i in done])
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
        _bookkeep(on_done, idx, results)
        resolve_many([futures[i] for i in idx], results, error)

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

    # --- housekeeping -------------------------------------------------------------------------
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


def _forget(saving: dict[bytes, list], key: bytes, dropped: bool) -> None:
    """One finished copy of a save in ``PageTransfer._saving`` (under its lock): ``dropped``
    (or its slice failed) settles one refusal of the key, if any was counted."""
    entry = saving.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if dropped and entry[2]:
        entry[2] -= 1
    if entry[1] <= 0:
        del saving[key]


def _bookkeep(on_done: Optional[DoneFn], done: list[int], results: Optional[list[Any]], skipped: Sequence[int] = ()) -> None:
    """``on_done`` of finished pages, before their futures resolve; never raises."""
    if on_done is None:
        return
    try:
        on_done(done, results, list(skipped))
    except Exception:  # never lose the pages' futures to the bookkeeping
        log.exception("gdskv: bookkeeping of a finished slice failed")


class _Reads:
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


class _Later(NamedTuple):
    """Native transfers in flight (``PageTransfer._later``), handed back by ``collect_done``:
    the indices of the native jobs among ``jobs``; ``reads`` for loads, None for saves."""

    group: int
    jobs: list[tuple]
    native: list[int]
    reads: Optional[_Reads]
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


def _as_list(segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A page's segments as the list its job holds: a list is taken as it is (its caller keeps it
    unchanged until the page's future resolves, as it keeps the page's memory; ``KvService``
    hands over lists of its own), so a page posted costs no second list."""
    return segments if type(segments) is list else list(segments)


def _started_pool(threads: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A transfer pool, its threads started now rather than by the first batch on the serving
    thread; each first lowers itself by ``nice`` (``gdskv.priority``; 0 leaves it alone)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=lower_this_thread, initargs=(nice,))
    for _ in range(threads):
        pool.submit(int)
    return pool


def _file_segments(pages: Sequence[torch.Tensor], trailer: Buffer) -> list[Segment]:
    """A chunk's engine segments: the page's regions end to end, then the trailer. Host regions
    go to the engine as byte views (made once here: each torch view op costs microseconds, and
    the engine would otherwise make several per region), device regions as tensors."""
    segs, off = [], 0
    for t in pages:
        nbytes = t.numel() * t.element_size()
        segs.append(Segment(off, memoryview(tensor_bytes(t).numpy()) if t.device.type == "cpu" else t))
        off += nbytes
    segs.append(Segment(off, trailer))
    return segs


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
