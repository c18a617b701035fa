"""The remote tier a ``KvService`` holds when ``[gdskv.remote]`` is configured.

- **Read-through** (``stored``): a lookup's keys that miss locally are fetched from the remote
  (``concurrency`` GETs in flight, started in prefix order, all inside one deadline, ``timeout``),
  verified as a local load verifies a chunk, and published into the local store; the lookup then
  serves them locally like any other chunk. Once a key is in neither tier, no request for a key
  after it is started (the served prefix stops there anyway). A miss is remembered for ``negative_ttl``;
  a bad object is a miss, counted (``remote_corrupt``) and remembered.
- **Health**: a request that gets no answer (connection refused, DNS, a timeout) marks the remote
  down for ``retry_after`` seconds, with one warning and a counter (``remote_unreachable``);
  meanwhile lookups are local only and cost nothing.
- **Uploads** (``gdskv.remote.upload.Uploader``): after a local publish, by upload mode.

Counters go to the namespace's shared counters (``gdskv stats`` sums them) and to ``counters``.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from gdskv.config import RemoteConfig
from gdskv.remote.client import ObjectClient, Outcome, Reply
from gdskv.remote.objects import chunk_key, publish, verify
from gdskv.remote.throttle import Throttle
from gdskv.remote.upload import Uploader
from gdskv.store import Counters, Namespace
from gdskv.transfer import SaveStatus

log = logging.getLogger(__name__)

NEGATIVE_CAPACITY = 1 << 16


class RemoteTier:
    """The shared tier of one service. ``uploads``: whether this service uploads (a service
    that transfers pages, with ``upload`` other than ``off``)."""

    def __init__(self, rc: RemoteConfig, auth_key: Optional[bytes], uploads: bool,
                 client: Optional[ObjectClient] = None, background_nice: int = 0) -> None:
        self.rc = rc
        self.auth_key = auth_key
        self.client = client if client is not None else ObjectClient(rc)
        self.counters = Counters()
        self._negative: dict[tuple[str, int, bytes], float] = {}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._refusals = Throttle(rc.retry_after)
        self.uploader: Optional[Uploader] = Uploader(self.client, rc, auth_key, self._count, self, nice=background_nice) \
            if uploads and rc.upload != "off" else None

    # -- health ------------------------------------------------------------------------------------
    @property
    def reachable(self) -> bool:
        return time.monotonic() >= self._down_until

    def unreachable(self, ns: Optional[Namespace], detail: str) -> None:
        """A request got no answer: leave the remote alone for ``retry_after`` (warn once per spell)."""
        with self._lock:
            was_up = self.reachable
            self._down_until = time.monotonic() + self.rc.retry_after
        if was_up:  # before the count: whoever sees the count can also see the warning
            log.warning("gdskv: remote %s (endpoint %s) unreachable (%s); serving from the local store only, "
                        "retrying in %.1f s", self.rc.url, self.rc.endpoint or "AWS S3", detail, self.rc.retry_after)
        self._count(ns, "remote_unreachable")

    def refused(self, detail: str) -> None:
        """A read was refused (credentials, permission, a bucket or region the endpoint does not
        take, an oversized object): its block is a miss; warn at most once per ``retry_after``,
        so that a wrong setting, which refuses every read, is said once, naming what to check.
        Called by ``_settle`` on a client worker thread."""
        if not self._refusals.ready():
            return
        log.warning("gdskv: remote %s (endpoint %s) refused a read (%s); such blocks are misses", self.rc.url,
                    self.rc.endpoint or "AWS S3", detail)

    def _count(self, ns: Optional[Namespace], name: str, n: int = 1) -> None:
        self.counters.add(name, n)
        if ns is not None:
            ns.counters.add(name, n)

    # -- read-through ------------------------------------------------------------------------------
    def stored(self, namespaces: Sequence[Namespace], group: int, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """For each key, whether every shard's chunk of it is now in the local store, fetching
        from the remote what misses locally, until ``deadline`` (``time.monotonic()``). Keys
        past the first that is in neither tier are answered from the local store alone. Never
        raises: a bug here is logged and the answer is the local store's."""
        try:
            return self._stored(namespaces, group, keys, deadline)
        except Exception as e:  # never into the serving loop
            log.exception("gdskv: remote read-through failed unexpectedly: %s", e)
            self._count(None, "remote_errors")
            return _local_presence(namespaces, group, keys)

    def _stored(self, namespaces: Sequence[Namespace], group: int, keys: Sequence[bytes], deadline: float) -> list[bool]:
        present = [True] * len(keys)
        for ns in namespaces:
            todo = [i for i, p in enumerate(present) if p]
            if not todo:
                break
            local = ns.contains_many(group, [keys[i] for i in todo])
            missing = [i for i, there in zip(todo, local) if not there]
            fetched = self._fetch_run(ns, group, [keys[i] for i in missing], deadline)
            for n, i in enumerate(missing):
                present[i] = n < len(fetched) and fetched[n]
        return present

    def _fetch_run(self, ns: Namespace, group: int, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """Fetch ``keys`` (in order, ``concurrency`` in flight); once one is in neither tier,
        the keys after it are not asked. Whether each is local now."""
        left = deadline - time.monotonic()
        if not keys or not self.reachable:
            return [False] * len(keys)
        if left <= 0:
            self._count(ns, "remote_deadline")
            return [False] * len(keys)
        now = time.monotonic()
        with self._lock:  # a remembered miss ends the run there
            end = next((i for i, k in enumerate(keys) if self._negative.get((ns.id, group, k), 0.0) > now), len(keys))
        ask = list(keys[:end])
        coming = set(ask).__contains__  # a parent among them may land after its child
        took = self.client.get_many([chunk_key(ns, group, k) for k in ask], left, max_bytes=ns.chunk_nbytes(group),
                                    then=lambda i, r: self._settle(ns, group, ask[i], r, coming), in_order=True)
        for t in took:
            if isinstance(t, Reply):  # not settled by the deadline
                self._count(ns, "remote_timeouts")
                self.unreachable(ns, t.detail)
                break
        return [t is True for t in took] + [False] * (len(keys) - len(took))

    def _settle(self, ns: Namespace, group: int, key: bytes, r: Reply, coming: Callable[[bytes], bool]) -> bool:
        """One reply of a read-through (on a client worker thread): whether ``key`` is local now.
        ``coming``: whether a block is among the read-through's keys (``publish``)."""
        if r.outcome is Outcome.OK:
            return self._take(ns, group, key, r.data, coming)
        if r.outcome in (Outcome.MISSING, Outcome.REFUSED):
            self._count(ns, "remote_misses" if r.outcome is Outcome.MISSING else "remote_refused")
            self._remember_miss(ns, group, key)
            if r.outcome is Outcome.REFUSED:
                self.refused(r.detail)
        else:
            self.unreachable(ns, r.detail)
        return False

    def _take(self, ns: Namespace, group: int, key: bytes, data: Any, coming: Callable[[bytes], bool]) -> bool:
        """Verify a fetched object and publish it locally; whether it is now local."""
        reason = verify(ns, group, key, data, self.auth_key)
        if reason is not None:
            self._count(ns, "remote_corrupt")
            self._remember_miss(ns, group, key)
            log.warning("gdskv: remote object %s failed verification (%s); treated as a miss",
                        chunk_key(ns, group, key), reason)
            return False
        try:
            if not publish(ns, group, key, data, coming):
                self._count(ns, "remote_dropped_budget")
                return False
        except OSError as e:
            self._count(ns, "remote_publish_failed")
            log.warning("gdskv: could not publish remote chunk %s locally: %s", chunk_key(ns, group, key), e)
            return False
        self._count(ns, "remote_hits")
        self._count(ns, "bytes_remote_read", memoryview(data).nbytes)
        return True

    def _remember_miss(self, ns: Namespace, group: int, key: bytes) -> None:
        with self._lock:
            if len(self._negative) >= NEGATIVE_CAPACITY:
                now = time.monotonic()
                self._negative = {k: t for k, t in self._negative.items() if t > now}
                while len(self._negative) >= NEGATIVE_CAPACITY:
                    self._negative.pop(next(iter(self._negative)))
            self._negative[(ns.id, group, key)] = time.monotonic() + self.rc.negative_ttl

    # -- uploads -----------------------------------------------------------------------------------
    def after_save(self, ns: Namespace, group: int, key: bytes, fut: "Future[SaveStatus]") -> "Future[SaveStatus]":
        """Upload ``key``'s chunk once ``fut`` (its local save) has published it: queued
        (``behind``), or before the returned future resolves (``through``)."""
        up = self.uploader
        if up is None:
            return fut
        if self.rc.upload == "behind":
            fut.add_done_callback(lambda f: up.enqueue(ns, group, key) if _published(f) else None)
            return fut
        return up.through(ns, group, key, fut)

    def start_leftovers(self, namespaces: Sequence[Namespace]) -> None:
        """Upload, in the background, what the local store holds and the remote lacks."""
        if self.uploader is not None:
            self.uploader.sync_in_background(namespaces)

    def close(self) -> None:
        """Drain the upload queue (at most ``drain`` seconds; the rest go at the next start)."""
        if self.uploader is not None:
            self.uploader.close()
        self.client.close()


def _local_presence(namespaces: Sequence[Namespace], group: int, keys: Sequence[bytes]) -> list[bool]:
    present = [True] * len(keys)
    for ns in namespaces:
        present = [p and there for p, there in zip(present, ns.contains_many(group, keys))]
    return present


def _published(f: Future) -> bool:
    return not f.cancelled() and f.exception() is None and f.result() is SaveStatus.PUBLISHED
