"""MAX's ``KVTransfer`` objects over ``KvService`` loads and saves, and the posting of them.

- ``post_load``: one job per chunk read (per leaf block and stored shard), on the connector's load
  threads: the chunk is read into a scratch page once the engine's kernels are done with the
  destination (``ready``), verified by the service, then copied into every destination shard's
  page, so a page never holds unverified bytes. ``LoadTransfer`` completes when every page
  landed, or raises ``KVLoadFailed`` from every poll once any failed and nothing is in flight.
- ``offload_work`` decides what an offload writes (``gdskv.planner.plan_offload``);
  ``post_offload`` posts one ``KvService.save`` per chunk; ``OffloadTransfer`` completes when every
  chunk was published, found stored already, or dropped (counted, never raised).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from functools import partial
from typing import Optional

import torch

from gdskv import streams
from gdskv.connectors.max.memory import LeafMemory, Pools
from gdskv.connectors.max.metrics import Meter
from gdskv.connectors.max.types import CompletedTransfer, KVConnectorTransfer, KVLoadFailed
from gdskv.planner import held_everywhere, plan_offload
from gdskv.service import KvService
from gdskv.transfer import LoadStatus, SaveStatus

log = logging.getLogger(__name__)

LoadChunk = tuple[str, int, bytes, int, list[torch.Tensor]]
"""``(leaf, layer group, key, source shard, destination pages)``: one chunk a load reads."""
SaveChunk = tuple[str, int, int, int, bytes, Optional[bytes], torch.Tensor]
"""``(leaf, block id, shard, layer group, key, parent key, page)``: one chunk an offload writes."""


class LoadTransfer:
    """The ``KVTransfer`` of one ``load``: complete when every page landed verified; raises
    ``KVLoadFailed`` from every poll once any page failed and nothing is in flight any more."""

    def __init__(self, meter: Meter, items: list[tuple[str, bytes, int]], blocks: int) -> None:
        """``items``: ``(leaf, key, bytes)`` of each job; ``blocks``: how many leaf blocks they fill."""
        self._meter = meter
        self._items = items
        self._blocks = blocks
        self.abort = threading.Event()
        self._mu = threading.Lock()
        self._futures: list[Future] = []
        self._pending = 0
        self._failure: Optional[str] = None
        self._settled = threading.Event()

    def start(self, futures: list[Future]) -> None:
        self._futures = futures
        self._pending = len(futures)
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: self._job_done(i, f))

    def _job_done(self, i: int, f: Future) -> None:
        leaf, key, _ = self._items[i]
        why = None
        if f.cancelled():
            why = "cancelled"
        elif f.exception() is not None:
            why = f"{type(f.exception()).__name__}: {f.exception()}"
        elif f.result() is None:
            why = "skipped"
        elif f.result() is not LoadStatus.LOADED:
            why = f.result().value
        first_failure = False
        with self._mu:
            if why is not None and self._failure is None:
                self._failure = f"gdskv: load of leaf {leaf!r} block {key.hex()} failed ({why})"
                first_failure = True
            self._pending -= 1
            last = self._pending == 0
        if first_failure:
            self.abort.set()
            for other in self._futures:
                other.cancel()
        if last:
            self._settle()

    def _settle(self) -> None:
        if self._failure is None:
            self._meter.settled(len(self._futures), loads=1, blocks_read=self._blocks,
                                bytes_read=sum(n for _, _, n in self._items))
        else:
            log.warning("%s; MAX recomputes the prefix", self._failure)
            self._meter.settled(len(self._futures), loads=1, load_failures=1)
        self._settled.set()

    def is_complete(self) -> bool:
        """Never blocks. ``True`` once every page holds its verified chunk."""
        if not self._settled.is_set():
            return False
        if self._failure is not None:
            raise KVLoadFailed(self._failure)
        return True

    def synchronize(self) -> None:
        """Wait until nothing is in flight (drain and shutdown)."""
        self._settled.wait()


def load_chunk(service: KvService, gid: int, key: bytes, shard: int, pages: list[torch.Tensor],
               abort: threading.Event, ready: Optional[streams.Readiness] = None) -> Optional[LoadStatus]:
    """One chunk into its pages (one per destination shard): read into scratch memory once
    ``ready``, verified, then copied; the copy has landed before this returns. Runs on a load
    thread, which bounds the scratch memory in use to one page per thread; ``None`` when the
    transfer failed before this chunk started, or the service moves nothing."""
    if abort.is_set():
        return None
    scratch = torch.empty_like(pages[0])
    fut = service.load(gid, key, [scratch], ready=ready, shard=shard)
    status = fut.result() if fut is not None else None
    if status is LoadStatus.LOADED and not abort.is_set():
        streams.copy_into(pages, scratch)
    return status


def post_load(service: KvService, jobs: Executor, meter: Meter, chunks: list[LoadChunk], blocks: int,
              ready: Optional[streams.Readiness]) -> LoadTransfer:
    """Post a load's ``chunks`` (filling ``blocks`` leaf blocks) on ``jobs``. ``KVLoadFailed``
    when they cannot be posted (connector shut down), with nothing left in flight."""
    transfer = LoadTransfer(meter, [(leaf, key, pages[0].numel()) for leaf, _, key, _, pages in chunks], blocks)
    futures: list[Future] = []
    try:
        for _, gid, key, src, pages in chunks:
            futures.append(jobs.submit(load_chunk, service, gid, key, src, pages, transfer.abort, ready))
    except Exception as e:  # nothing may stay in flight into the pages
        transfer.abort.set()
        for f in futures:
            f.cancel()
        for f in futures:
            try:
                f.result()
            except BaseException:  # cancelled or failed: either way it no longer runs
                pass
        meter.count(load_failures=1)
        raise KVLoadFailed(f"gdskv: could not post the load: {e}") from e
    meter.count(inflight=len(futures))
    transfer.start(futures)
    return transfer


class OffloadTransfer:
    """The ``KVConnectorTransfer`` of one ``offload``: complete when every chunk was written and
    published, or dropped. Never raises."""

    def __init__(self, meter: Meter, taken: dict[str, list[int]], reap: Callable[[], None]) -> None:
        """``reap``: ``KvService.reap``, which finishes saves on the caller's thread (MAX's
        serving loop, in ``is_complete``) rather than a transfer thread's."""
        self._meter = meter
        self._taken = taken
        self._reap = reap
        self._mu = threading.Lock()
        self._pending = 0
        self._jobs = 0
        self._status: dict[tuple[str, int], list[Optional[SaveStatus]]] = {}
        self._bytes = 0
        self._settled = threading.Event()

    @property
    def g0_blocks_per_leaf(self) -> Mapping[str, Sequence[int]]:
        """The device blocks this offload reads (MAX keeps them pinned until it completes)."""
        return self._taken

    def start(self, posted: list[tuple[tuple[str, int], int, Future]], unposted: set[tuple[str, int]]) -> None:
        """The posted jobs (``(leaf, block id)``, bytes, future; at least one) and the blocks
        whose jobs could not be posted (counted as dropped)."""
        for block in unposted:
            self._status.setdefault(block, []).append(None)
        self._pending = self._jobs = len(posted)
        for block, nbytes, f in posted:
            f.add_done_callback(lambda f, block=block, nbytes=nbytes: self._job_done(block, nbytes, f))

    def _job_done(self, block: tuple[str, int], nbytes: int, f: Future) -> None:
        status = None if f.cancelled() or f.exception() is not None else f.result()
        with self._mu:
            self._status.setdefault(block, []).append(status)
            if status is SaveStatus.PUBLISHED:
                self._bytes += nbytes
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._settle()

    def _settle(self) -> None:
        written = dropped = 0
        for statuses in self._status.values():
            if any(s is None or s is SaveStatus.DROPPED for s in statuses):
                dropped += 1
            elif any(s is SaveStatus.PUBLISHED for s in statuses):
                written += 1
        self._meter.settled(self._jobs, blocks_written=written, bytes_written=self._bytes,
                            offload_blocks_dropped=dropped)
        self._settled.set()

    def is_complete(self) -> bool:
        """Never blocks; ``True`` once every chunk settled (published, already there, dropped)."""
        if not self._settled.is_set():
            self._reap()
        return self._settled.is_set()

    def synchronize(self) -> None:
        """Wait until every chunk settled."""
        while not self._settled.wait(0.005):
            self._reap()


def offload_work(service: KvService, pools: Pools, mem: Mapping[str, LeafMemory],
                 plan: Mapping[str, list[tuple[int, bytes]]]) -> tuple[list[SaveChunk], dict[str, list[int]], int]:
    """What an offload of ``plan`` (``{leaf: [(block id, key), ...]}`` from replica memory ``mem``)
    writes (``gdskv.planner.plan_offload``: blocks not stored on every shard that stores the leaf,
    each with its parent, the run's first one's from the service's lineage): the chunks, the
    device blocks they read per leaf, and how many blocks were skipped as stored."""
    work: list[SaveChunk] = []
    taken: dict[str, list[int]] = {}
    skipped = 0
    for leaf, pairs in plan.items():
        if not pairs:
            continue
        keys = [k for _, k in pairs]
        gid, shards, chained = pools.gid[leaf], pools.store_shards(leaf), pools.chained(leaf)
        stored = held_everywhere(keys, [partial(service.held, gid, shard=s) for s in shards])
        if chained:
            service.lineage.learn(keys)
        writes = plan_offload(keys, stored, service.lineage.parent_of(keys[0]) if chained else None, chained)
        skipped += len(keys) - len(writes)
        for i, parent in writes:
            bid, key = pairs[i]
            work.extend((leaf, bid, s, gid, key, parent, mem[leaf].page(s, bid)) for s in shards)
            taken.setdefault(leaf, []).append(bid)
    return work, taken, skipped


def post_offload(service: KvService, meter: Meter, work: list[SaveChunk], taken: dict[str, list[int]],
                 ready: Optional[streams.Readiness]) -> KVConnectorTransfer:
    """Post an offload's chunks as service saves. A chunk that cannot be posted (connector shut
    down, store unusable) drops its block, counted; a ``CompletedTransfer`` when none posted."""
    posted: list[tuple[tuple[str, int], int, Future]] = []
    unposted: set[tuple[str, int]] = set()
    batches: dict[tuple[int, int], list[SaveChunk]] = {}
    for chunk in work:  # one batch per (layer group, shard): a few hand-offs, not one per chunk
        batches.setdefault((chunk[3], chunk[2]), []).append(chunk)
    for (gid, shard), chunks in batches.items():
        try:
            futures = service.save_many(gid, [(key, parent, [page]) for _, _, _, _, key, parent, page in chunks],
                                        ready=ready, shard=shard)
        except Exception as e:
            log.warning("gdskv: could not post an offload of %d chunks of layer group %d: %s", len(chunks), gid, e)
            futures = [None] * len(chunks)
        for (leaf, bid, _, _, _, _, page), fut in zip(chunks, futures):
            if fut is None:
                unposted.add((leaf, bid))
            else:
                posted.append(((leaf, bid), page.numel(), fut))
    if not posted:
        meter.count(offload_blocks_dropped=len(unposted))
        return CompletedTransfer()
    meter.count(inflight=len(posted))
    transfer = OffloadTransfer(meter, taken, service.reap)
    transfer.start(posted, unposted)
    return transfer
