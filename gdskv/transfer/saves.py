"""Saves: a page slot written to a temporary file beside its chunk, sealed, renamed into place.

The save half of ``PageTransfer`` (``gdskv.transfer.core``): ``save_page``/``save_pages`` for the
service and the connector workers, the per-page path (``_save``) and the native batch path
(``_save_native``: checks and admission here, sealing, writing and publishing with the GIL
released). A trailer carries the payload checksum and the full keys; a reader sees a whole chunk
or none. A full disk, a refusal of the budget or a vanished store is a dropped save, counted and
logged, never an error in the serving loop.
"""
from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import Future
from typing import Any, Optional, Sequence

import torch

from gdskv import checksum
from gdskv import format as fmt
from gdskv.confined import dir_path
from gdskv.copies import gather
from gdskv.io import batch as batchio
from gdskv.io.base import Segment
from gdskv.transfer.batches import NATIVE_CALLERS
from gdskv.transfer.pages import DoneFn, SaveStatus, as_list, file_segments

log = logging.getLogger(__name__)


class SavePath:
    """The save methods of ``PageTransfer``, which holds their state (``gdskv.transfer.core``)."""

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
        jobs = [(item[0], item[1], as_list(item[2]), item[3] if len(item) > 3 else None) for item in items]
        on_done = self._posted(group, jobs, on_done)
        if ready is None and jobs and self._later_ready() and not self._any_staged(jobs, 2):
            return self._later(group, jobs, on_done, save=True)
        return self._batch(self._save, self._save_slice, group, jobs, ready, on_done, self._background, NATIVE_CALLERS)

    def _posted(self, group: int, jobs: list[tuple], on_done: Optional[DoneFn]) -> Optional[DoneFn]:
        """Note a step's saves as on their way (``SavesOnTheirWay``) until they finish, where a
        budget may evict for them: the returned ``on_done``, which every path runs for every page
        before its future resolves, forgets them, then runs the caller's."""
        if not getattr(self.ns.store.budget, "evicts", False):
            return on_done
        forget = self._saving.post(group, jobs)

        def finished(done: list[int], results: Optional[list[Any]], skipped: list[int]) -> None:
            forget(done, results, skipped)
            if on_done is not None:
                on_done(done, results, skipped)

        return finished

    def _admit(self, budget: Any, group: int, nbytes: int, parent: Optional[bytes]) -> bool:
        """``Budget.admit`` for a save of a chunk of ``nbytes`` under ``parent``, which asks the
        chain's lineage once it may evict, not before it waited."""
        return budget.admit(self.ns, group, nbytes, lineage=lambda: self._saving.lineage(group, parent))

    def _refused(self, group: int, key: bytes) -> SaveStatus:
        """A save the budget refused: counted, and this copy no longer on its way from now
        (``SavesOnTheirWay.refused``)."""
        self.ns.counters.add("saves_dropped")
        self.ns.counters.add("saves_dropped_budget")
        self._saving.refused(group, key)
        return SaveStatus.DROPPED

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
        segs = file_segments(segments, trailer)
        if budget is not None:
            budget.on_publishing(ns, group, [(key, parent)], nbytes + fmt.TRAILER_BYTES)
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
        if budget is not None and native:
            budget.on_publishing(ns, group, [jobs[i][:2] for i in native], chunk_bytes)
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


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
