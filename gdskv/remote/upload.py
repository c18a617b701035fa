"""Uploads of locally published chunks to the remote tier, create-only.

Every upload is a conditional create (``If-None-Match: *``): two nodes saving the same block never
overwrite each other, and a published object is never replaced. Before a chunk goes up it is read
back from the local store and verified (a chunk damaged on local disk never reaches the bucket),
and its namespace's ``zarr.json`` documents are uploaded first (once per process), so the bucket
is a Zarr hierarchy at every moment.

- ``behind``: ``enqueue`` puts the chunk on a bounded queue and returns at once (a full queue is
  counted, ``remote_upload_deferred``, never waited on); ``threads`` workers upload from it.
- ``through``: ``through`` resolves a save's future only once its upload has been tried.
- leftovers: the local store is the queue's durable record. ``sync_in_background`` (at bring-up)
  lists the remote's objects of each namespace and uploads every local chunk it lacks, so what
  was queued, deferred or unreachable at shutdown goes up at the next start.

A refused upload (permission, a bad request) is dropped with a counter (``remote_upload_refused``)
and a warning at most once per ``retry_after`` (``gdskv.remote.throttle``: a wrong credential
refuses every upload);
one that gets no answer marks the remote down (``RemoteTier.unreachable``) and is left to the
next start (``remote_upload_failed``). Called by ``gdskv.remote.tier`` and ``gdskv.remote.copy``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from gdskv import format as fmt
from gdskv.config import RemoteConfig
from gdskv.priority import lower_this_thread
from gdskv.remote.client import ObjectClient, Outcome, RemoteUnavailable
from gdskv.remote.objects import chunk_key, metadata_keys, read_local, verify
from gdskv.remote.throttle import Throttle
from gdskv.store import Namespace

log = logging.getLogger(__name__)

UPLOAD_TIMEOUT = 5.0
"""Seconds an upload may take at least (a page over a slow link may need more than a lookup's
``timeout``); an upload that takes longer counts as unreachable and is left for the next start."""

Count = Callable[[Optional[Namespace], str, int], None]


class Uploader:
    """Create-only uploads for one remote tier. ``health``: the tier (``reachable``,
    ``unreachable(ns, detail)``)."""

    def __init__(self, client: ObjectClient, rc: RemoteConfig, auth_key: Optional[bytes], count: Count, health: Any,
                 threads: Optional[int] = None, nice: int = 0) -> None:
        """``nice``: how much nicer than the caller the upload threads run (the config's
        ``background_nice``: nothing waits on an upload in a step; ``gdskv.priority``)."""
        self.client = client
        self._nice = nice
        self.rc = rc
        self.auth_key = auth_key
        self._count = count
        self._health = health
        self._queue: "queue.Queue[tuple[Namespace, int, bytes]]" = queue.Queue(maxsize=rc.queue)
        self._metadata_done: set[str] = set()
        self._meta_lock = threading.Lock()
        self._closing = False
        self._workers = [threading.Thread(target=self._work, name=f"gdskv-upload-{i}", daemon=True)
                         for i in range(threads or min(rc.concurrency, 8))]
        for t in self._workers:
            t.start()
        self._through = ThreadPoolExecutor(max_workers=min(rc.concurrency, 8), thread_name_prefix="gdskv-upload-through",
                                           initializer=lower_this_thread, initargs=(nice,))
        self._sync: Optional[threading.Thread] = None
        self._put_timeout = max(rc.timeout, UPLOAD_TIMEOUT)
        self._refusals = Throttle(rc.retry_after)
        self.listing_refused = ""
        """Why the remote refused to list a namespace (``sync`` uploaded nothing), if it did."""
        self._missed = False
        """Uploads were skipped or failed for want of an answer since the last pass over the store."""
        self._namespaces: list[Namespace] = []

    # -- entry points ------------------------------------------------------------------------------
    def enqueue(self, ns: Namespace, group: int, key: bytes) -> bool:
        """Queue ``key``'s chunk for upload; False (counted) when the queue is full or closing."""
        if self._closing:
            self._count(ns, "remote_upload_deferred", 1)
            return False
        try:
            self._queue.put_nowait((ns, group, key))
            return True
        except queue.Full:
            self._count(ns, "remote_upload_deferred", 1)
            return False

    def through(self, ns: Namespace, group: int, key: bytes, fut: Future) -> Future:
        """A future that resolves as the save ``fut`` does, once a published chunk's upload was tried."""
        out: Future = Future()

        def relay(f: Future) -> None:
            if f.cancelled():
                out.cancel()
                return
            if f.exception() is not None:
                out.set_exception(f.exception())
                return
            status = f.result()
            if getattr(status, "value", None) != "published":
                out.set_result(status)
                return
            try:
                self._through.submit(self._upload_then, ns, group, key, status, out)
            except RuntimeError:  # closing: the chunk is local, and goes up at the next start
                self._count(ns, "remote_upload_deferred", 1)
                out.set_result(status)

        fut.add_done_callback(relay)
        return out

    def _upload_then(self, ns: Namespace, group: int, key: bytes, status: Any, out: Future) -> None:
        try:
            self.upload(ns, group, key)
        except Exception as e:  # a bug is a chunk left for the next start, never a save that hangs
            log.exception("gdskv: upload failed unexpectedly: %s", e)
        finally:
            out.set_result(status)

    # -- one upload --------------------------------------------------------------------------------
    def upload(self, ns: Namespace, group: int, key: bytes) -> Outcome:
        """Upload ``key``'s local chunk (create-only) after its namespace's metadata."""
        return self.upload_rel(ns, group, chunk_key(ns, group, key), key)

    def upload_rel(self, ns: Namespace, group: int, rel: str, key: Optional[bytes] = None) -> Outcome:
        """Upload the local chunk at ``rel`` (its block key read from its trailer when not given)."""
        if not self._health.reachable:
            self._count(ns, "remote_upload_failed", 1)
            self._missed = True
            return Outcome.UNREACHABLE
        try:
            data = read_local(ns.store, rel, ns.chunk_nbytes(group))
            if key is None:
                key = fmt.unpack(data[-fmt.TRAILER_BYTES:]).block_key
        except (OSError, fmt.ChunkFormatError, ValueError):
            self._count(ns, "remote_upload_skipped", 1)  # evicted meanwhile, or not a sound chunk
            return Outcome.MISSING
        if chunk_key(ns, group, key) != rel or verify(ns, group, key, data, self.auth_key) is not None:
            self._count(ns, "remote_upload_skipped", 1)
            return Outcome.REFUSED
        meta = self.ensure_metadata(ns)
        if meta is not Outcome.OK:
            if meta is Outcome.UNREACHABLE:
                self._missed = True
            self._count(ns, "remote_upload_failed" if meta is Outcome.UNREACHABLE else "remote_upload_refused", 1)
            return meta
        reply = self.client.put_create(rel, data, timeout=self._put_timeout)
        if reply.outcome in (Outcome.OK, Outcome.EXISTS) and self._missed:
            self._resync()
        if reply.outcome is Outcome.OK:
            self._count(ns, "remote_uploaded", 1)
            self._count(ns, "bytes_remote_written", len(data))
        elif reply.outcome is Outcome.EXISTS:
            self._count(ns, "remote_upload_exists", 1)
        elif reply.outcome is Outcome.REFUSED:
            self._count(ns, "remote_upload_refused", 1)
            if self._refusals.ready():
                log.warning("gdskv: remote refused %s (%s); dropped (it stays local; further refusals for %.0f s "
                            "are only counted, remote_upload_refused)", rel, reply.detail, self.rc.retry_after)
        else:
            self._count(ns, "remote_upload_failed", 1)
            self._missed = True
            self._health.unreachable(ns, reply.detail)
        return reply.outcome

    def _resync(self) -> None:
        """The remote answers again after uploads were missed: upload what it lacks, in the
        background (at most one such pass at a time)."""
        with self._meta_lock:
            if not self._missed or (self._sync is not None and self._sync.is_alive()) or not self._namespaces:
                return
            self._missed = False
        self.sync_in_background(self._namespaces)

    def ensure_metadata(self, ns: Namespace) -> Outcome:
        """Upload the ``zarr.json`` documents ``ns`` needs (create-only), once per process
        (concurrent callers may both try: create-only makes that harmless). ``OK`` when they
        are there, else the outcome that stopped it."""
        with self._meta_lock:
            if ns.id in self._metadata_done:
                return Outcome.OK
        for rel in metadata_keys(ns):
            if not self._health.reachable:
                return Outcome.UNREACHABLE
            try:
                doc = ns.store.fs.read_small(rel)
            except OSError as e:
                log.warning("gdskv: cannot read %s to upload it: %s", rel, e)
                return Outcome.MISSING
            reply = self.client.put_create(rel, doc, timeout=self._put_timeout)
            if reply.outcome is Outcome.UNREACHABLE:
                self._health.unreachable(ns, reply.detail)
                return reply.outcome
            if reply.outcome is not Outcome.OK and reply.outcome is not Outcome.EXISTS:
                if self._refusals.ready():
                    log.warning("gdskv: remote refused %s (%s); further refusals for %.0f s are only counted "
                                "(remote_upload_refused)", rel, reply.detail, self.rc.retry_after)
                return reply.outcome
        with self._meta_lock:
            self._metadata_done.add(ns.id)
        return Outcome.OK

    # -- leftovers ---------------------------------------------------------------------------------
    def sync(self, namespaces: Sequence[Namespace], threads: int = 1) -> int:
        """Upload every local chunk of ``namespaces`` the remote lacks (``threads`` at a time); how
        many went up. Keys the listing leaves out are counted (``remote_unaddressable_keys``), logged."""
        sent = 0
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gdskv-upload-sync") as pool:
            for ns in namespaces:
                unaddressable: list[str] = []
                try:
                    there = {o.key for o in self.client.list(f"ns/{ns.id}/", unaddressable.append)}
                except RemoteUnavailable as e:
                    if e.outcome is Outcome.UNREACHABLE:
                        self._missed = True
                        self._health.unreachable(ns, str(e))
                    else:
                        self.listing_refused = str(e)
                        if self._refusals.ready():
                            log.warning("gdskv: %s; local chunks not uploaded", e)
                    return sent
                if unaddressable:
                    self._count(ns, "remote_unaddressable_keys", len(unaddressable))
                    log.warning("gdskv: %s/ns/%s/: left out %d key(s) no client can address, such as %r",
                                self.rc.url, ns.id, len(unaddressable), unaddressable[0])
                todo = [(array.group, f"ns/{ns.id}/g{array.group}/c/{e.hi}/0/{e.name}")
                        for array in ns.store.arrays([ns]) for e in ns.store.chunk_entries(array, with_stat=False)
                        if e.is_chunk]
                todo = [(g, rel) for g, rel in todo if rel not in there]
                for outcome in pool.map(lambda t: self._leftover(ns, *t), todo):
                    if outcome is Outcome.OK:
                        sent += 1
        return sent

    def _leftover(self, ns: Namespace, group: int, rel: str) -> Optional[Outcome]:
        if self._closing or not self._health.reachable:
            return None
        outcome = self.upload_rel(ns, group, rel)
        if outcome is Outcome.OK:
            self._count(ns, "remote_leftovers_uploaded", 1)
        return outcome

    def sync_in_background(self, namespaces: Sequence[Namespace]) -> None:
        """``sync`` on a thread of its own; also run again whenever the remote answers after a
        spell in which uploads were missed."""
        self._namespaces = list(namespaces)
        self._sync = threading.Thread(target=self._sync_logged, args=(list(namespaces),), name="gdskv-upload-leftovers",
                                      daemon=True)
        self._sync.start()

    def _sync_logged(self, namespaces: list[Namespace]) -> None:
        lower_this_thread(self._nice)
        try:
            n = self.sync(namespaces)
            if n:
                log.info("gdskv: uploaded %d chunk(s) left over from earlier runs to %s", n, self.rc.url)
        except Exception as e:  # never into serving: a bug here leaves the leftovers for the next start
            log.exception("gdskv: uploading leftovers to %s failed: %s", self.rc.url, e)

    # -- workers -----------------------------------------------------------------------------------
    def _work(self) -> None:
        lower_this_thread(self._nice)
        while not self._closing:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if self._closing:
                    self._count(item[0], "remote_upload_deferred", 1)
                    continue
                self.upload(*item)
            except Exception as e:  # a bug is a chunk left for the next start, logged
                log.exception("gdskv: upload failed unexpectedly: %s", e)
            finally:
                self._queue.task_done()

    def close(self) -> None:
        """Wait up to ``drain`` seconds for queued uploads, then stop (the rest stay local and go
        up at the next start)."""
        end = time.monotonic() + self.rc.drain
        while self._queue.unfinished_tasks and time.monotonic() < end and self._health.reachable:
            time.sleep(0.01)
        self._closing = True
        left = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            left += 1
            self._count(item[0], "remote_upload_deferred", 1)
        stop = max(end, time.monotonic()) + 0.25  # a worker mid-upload is abandoned after this
        for t in self._workers:
            t.join(timeout=max(0.0, stop - time.monotonic()))
        self._through.shutdown(wait=True)
        if self._sync is not None:
            self._sync.join(timeout=max(0.0, end - time.monotonic()))
        if left:
            log.info("gdskv: %d upload(s) not done at shutdown; they go up at the next start", left)
