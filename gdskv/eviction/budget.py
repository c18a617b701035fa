"""Eviction budget: the capacity hook ``PageTransfer`` calls on ``store.budget``.

``Budget`` implements the hook (``admit``, ``on_publishing``, ``on_published``, ``pin``, ``unpin``,
``on_touched``); ``install_budget(store, cfg)`` sets it at bring-up in every process that writes
chunks. It keeps the chunk index (``gdskv.eviction.catalog``) current with what the process saves
and loads, and, when the config has a byte budget or a free-space floor, counts and evicts from it.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter, deque
from typing import Callable, Optional, Sequence

import numpy as np

from gdskv.config import GdsKvConfig
from gdskv.eviction import catalog
from gdskv.eviction.index import chunk_indexes, chunk_records, rebuild_catalog
from gdskv.eviction.journal import INTENT, PUBLISH, TOUCH, journal_of, records
from gdskv.eviction.policy import Limits, _norm, select_victims, shortfall
from gdskv.eviction.removal import Removal, remove_chunks
from gdskv.store import Namespace, PageStore

log = logging.getLogger(__name__)

INFLIGHT_TTL_S = 60.0
"""How long ``Budget`` counts an admitted save that has not published (it may have failed)."""

EVICT_ROUNDS = 3
"""Rankings an eviction makes at most: another after one whose victims turned out used since the
index saw them."""
LOOK_AHEAD = 4
"""An eviction's later rounds read the recency of the chunks that would free this many times the
bytes still wanted from their files before ranking again."""

REFRESH_S = 2.0
"""How often a budget with a limit reads the index, for what other processes saved and evicted since."""
UNLIMITED_REFRESH_S = 60.0
"""How often a budget without a limit reads the index: only its folds, its walks and the metrics'
store size depend on the count, and a count every 2 s on the engine's CPUs slowed decode steps
with saves running (``scripts/bench_ttft.py --only decode``)."""

DiskUsage = Callable[[str], tuple[int, int]]
Lineage = Callable[[], tuple[Optional[bytes], Sequence[bytes]]]


def disk_usage(path: str) -> tuple[int, int]:
    """``(size, free bytes)`` of the file system holding ``path`` (free: what a non-root user
    can still write). ``Budget``'s default probe; also used by ``gdskv info`` / ``evict``."""
    u = shutil.disk_usage(path)
    return u.total, u.free


def _allocation_unit(path: str) -> int:
    """The file system's allocation unit (``f_frsize``): what a file's size is rounded up to."""
    try:
        return max(1, os.statvfs(path).f_frsize)
    except OSError:
        return 4096


class Budget:
    """The capacity hook ``PageTransfer`` calls through ``store.budget``.

    ``admit`` before every save (after the chunk was found absent), ``on_publishing`` right before
    its write, ``on_published`` after the rename, ``pin``/``unpin`` around every load;
    ``on_touched`` after a lookup's lease (``Namespace.lease_many``). The store's chunk bytes come
    from the chunk index (``gdskv.eviction.catalog``), never from a walk on the serving path: read
    on a background thread at bring-up and every ``refresh_seconds`` (other processes' saves and
    evictions are in their journals), plus what this process admitted since; read again sooner once
    this process admitted ``headroom`` of a byte budget since (``_stale``: other processes fill the
    room a read showed too). Until the first read lands, the estimate is the file system's used
    bytes (never less than the store's): saves that fit even so go ahead, others are dropped. When a
    save does not fit, the index is read whole, ranked, and the victims removed (``remove_chunks``,
    which re-checks every file); an eviction frees what the save needs plus ``headroom`` (a fraction
    of the budget, or of the floor when only a floor is set), so one eviction serves many saves; the
    evicting save's own room is held from the start, so saves admitted meanwhile take only what is
    freed beyond it. A save that does not fit while another thread evicts waits at most
    ``max_wait_seconds`` for it, then is dropped. The background thread also folds grown journals
    into the snapshot (``compact``) and walks the store when it has no index or its last walk is
    older than ``rewalk_seconds`` (``rebuild_catalog``: what a crash kept out of the journals comes
    back; a killed save's chunks come back sooner, at the next count: ``on_publishing``).
    ``disk_usage``, ``clock`` and ``block_size`` (the allocation unit the floor counts in) are
    injectable for tests.
    """

    def __init__(self, store: PageStore, limits: Limits, headroom: float = 0.05, refresh_seconds: float = REFRESH_S,
                 max_wait_seconds: float = 2.0, disk_usage: DiskUsage = disk_usage, clock: Callable[[], float] = time.monotonic,
                 block_size: Optional[int] = None, rewalk_seconds: float = 24 * 3600.0, compact_records: int = 1 << 18) -> None:
        self.store = store
        self.limits = limits
        self.headroom = headroom
        self.refresh_seconds = refresh_seconds
        self.rewalk_seconds = rewalk_seconds
        self.compact_records = compact_records
        self.max_wait_seconds = max_wait_seconds
        self.disk_usage = disk_usage
        self.clock = clock
        self.journal = journal_of(store)
        self._used: Optional[int] = None  # chunk bytes: last index read + admitted since
        self._inflight: deque[tuple[float, int]] = deque()  # (admitted at, bytes) not yet published
        self._inflight_bytes = 0
        self._inflight_blocks = 0  # the same saves in the file system's allocation units
        self._block = block_size or _allocation_unit(str(store.root))
        self._counting = False
        self._published_while_counting: list[tuple[Optional[tuple[str, int]], int]] = []
        """``(where the journal records ended, bytes)`` of publishes while counting."""
        self._counted_to: dict[str, int] = {}  # how far the last count read each journal
        self._admitted_since_count = 0  # bytes reserved since the index was last read
        self._evictions = 0  # evictions that changed ``_used``: a count read before one is stale
        self._removing = 0  # removals under way: a count that ends during one may have read it already
        self._counted_at = float("-inf")
        self._background: Optional[threading.Thread] = None
        self.counted = threading.Event()  # set once the index was read (or found missing and walked)
        self._state = threading.Lock()  # guards the fields above; held for microseconds
        self._evicting = threading.Lock()  # one eviction at a time
        self._pins: Counter[str] = Counter()
        self._error_logged_at = float("-inf")

    @property
    def evicts(self) -> bool:
        """Whether the config set a limit (``max_bytes``, a free-space floor): without one this
        budget admits every save and only keeps the index."""
        return self.limits.active

    @property
    def used_bytes(self) -> Optional[int]:
        """The current estimate of the store's chunk bytes, saves in flight included (None before
        the index was first read)."""
        return None if self._used is None else self._used + self._inflight_bytes

    # hook -------------------------------------------------------------------------------------
    def admit(self, ns: Namespace, group: int, nbytes: int, parent: Optional[bytes] = None,
              saving: Sequence[bytes] = (), lineage: Optional[Lineage] = None) -> bool:
        """May a chunk of ``nbytes`` be written now? Evicts first when it would cross a limit;
        False (the caller drops and counts the save) when not enough can be evicted, e.g.
        because everything left is pinned, or the index is not ready yet. The chunk's ``parent``
        block (and so its ancestors) is not evicted to make room for it, and nothing is evicted
        for a chunk whose parent is not stored: either would leave the new chunk unservable.
        ``saving``: the chunk's nearest ancestors that the caller is saving right now (not
        stored yet, or just published), nearest first; ``parent`` is then the block above them,
        which must be stored. They are kept as ``parent`` is, so a chain saved in one go on a
        full store evicts for all of its blocks, not only the first. ``lineage``: in place of both,
        a function giving ``(parent, saving)``, asked once this thread may evict (a save of the
        chain may have been refused while it waited; then its children are not worth room).
        Never raises: an eviction that fails (I/O error, bad index) drops the save, with a log
        line and the namespace's ``eviction_errors`` counter.
        Called by ``PageTransfer`` on a transfer thread, never on the serving loop (which asks
        ``admit_now``)."""
        try:
            return self._admit(ns, group, nbytes, lineage or (lambda: (parent, saving)))
        except (OSError, ValueError) as e:
            ns.counters.add("eviction_errors")
            self._log_error(f"gdskv: eviction in {self.store.root} failed, save dropped: {e}")
            return False

    def admit_now(self, nbytes: int, count: int = 1) -> int:
        """``admit`` without evicting or waiting, for ``count`` chunks of ``nbytes`` at once: how
        many of them fit now (the first that many, reserved as ``admit`` reserves them; the file
        system asked once). Called by ``PageTransfer`` for a step's saves it posts from the
        serving loop's thread; the rest go to a transfer thread, whose ``admit`` makes room, so
        no step waits for an eviction."""
        if self.clock() - self._counted_at > self.refresh_seconds:
            self.start_background()
        return self._try_reserve(nbytes, count)

    def _admit(self, ns: Namespace, group: int, nbytes: int, lineage: Lineage) -> bool:
        if self.admit_now(nbytes):
            return True
        if self._stale(nbytes) and self._count(walk=False) and self.admit_now(nbytes):
            return True  # what other processes saved since the last read is counted now
        if not self._evicting.acquire(timeout=self.max_wait_seconds):
            return False  # another thread is still making room: a late save is worth less than a free thread
        try:
            if self._try_reserve(nbytes):  # another thread evicted meanwhile
                return True
            if self._used is None and not self._count(walk=False):
                return False  # no index yet (the background thread walks the store): the conservative estimate says no
            parent, saving = lineage()
            if parent is not None and not ns.contains(group, parent):
                return False  # the chunk would be unservable: not worth evicting anything for
            with self._state:
                # ``admit_now`` does not wait for ``_evicting``: this save's room is held first
                self._reserve(self.clock(), nbytes)
                need = self._need(0)
            fits = False
            try:
                if need > 0:
                    keep = [*saving, parent] if parent is not None else saving
                    self.evict(need, protect=[ns.chunk_path(group, k) for k in keep])
                with self._state:
                    fits = self._need(0) == 0
            finally:
                if not fits:
                    with self._state:
                        self._unreserve(nbytes)
            return fits
        finally:
            self._evicting.release()

    def evict(self, need: int, protect: Sequence[str] = ()) -> Removal:
        """Remove at least ``need`` bytes plus the headroom, least recently used first, from the
        index; pinned chunks, ``protect`` and their ancestors stay. Chunks used since the index
        last saw them (a load stamps its chunk after the lookup journaled it) are kept. The
        ranking is then made again, up to ``EVICT_ROUNDS`` times while ``need`` itself is not
        met, after reading the recency of the chunks it would choose among (``LOOK_AHEAD`` times
        the bytes still wanted) from their files, so a stale index costs a few ``lstat``s, not
        the save. The index is read once: a later ranking is made on the same table less the
        chunks removed (at ten million chunks a reading takes seconds, and other saves that need
        room wait meanwhile). Caller holds ``_evicting``."""
        base = self.limits.max_bytes or self.limits.floor_bytes(self.disk_usage(str(self.store.root))[0])
        want = need + int(self.headroom * base)
        done = Removal()
        try:
            rows, _, _ = catalog.read(self.store)
        except catalog.CatalogMissing:
            self.start_background()
            return done
        table = catalog.table(self.store, rows)
        for round_ in range(EVICT_ROUNDS):
            with self._state:
                pinned = table.rows_of(list(self._pins) + list(protect))
            left = want - done.freed_bytes
            if round_:
                self._recency_from_files(table, select_victims(table, LOOK_AHEAD * left, pinned, now_ns=time.time_ns()))
            order = select_victims(table, left, pinned, now_ns=time.time_ns())
            with self._state:
                self._removing += 1
            got = Removal()
            try:
                got = remove_chunks(self.store, table, order, lambda p: self._pins[_norm(p)] > 0, self._state)
            finally:
                with self._state:
                    self._removing -= 1
                    self._used = max(0, (self._used or 0) - got.freed_bytes)
                    self._evictions += 1
            done += got
            if done.freed_bytes >= need or not got.skipped_fresh:
                break  # the headroom alone is not worth another ranking
            table = table.without(got.freed_rows)
        if done.removed:
            log.info("gdskv: evicted %d chunks (%d bytes) to stay within %s", done.removed, done.removed_bytes, self.limits)
        return done

    def _recency_from_files(self, table: catalog.ChunkTable, rows: Sequence[int]) -> None:
        """Raise ``table``'s recency of ``rows`` to their files' mtimes where those are newer
        (``evict``'s later rounds); a file that cannot be stat-ed keeps the index's."""
        for row in rows:
            ref = table.arrays[int(table.array[row])]
            try:
                mtime = self.store.fs.lstat(ref.chunk_rel(int(table.index[row]))).st_mtime_ns
            except OSError:
                continue
            if mtime > table.mtime_ns[row]:
                table.mtime_ns[row] = mtime

    def on_publishing(self, ns: Namespace, group: int, chunks: Sequence[tuple[bytes, Optional[bytes]]], nbytes: int) -> None:
        """Chunks of ``nbytes`` each, ``(key, parent)``, are about to be written and renamed into
        place: journal the intent (``gdskv.eviction.intents``). Called by ``PageTransfer`` and the
        remote tier's read-through before they write."""
        self.journal.append(chunk_records(INTENT, ns, group, chunks, nbytes))

    def on_published(self, ns: Namespace, group: int, key: bytes, parent: Optional[bytes], nbytes: int) -> None:
        """A chunk was renamed into place (``on_published_many`` for one). Called by
        ``PageTransfer._save`` and the remote tier's read-through."""
        self.on_published_many(ns, group, [(key, parent)], nbytes)

    def on_published_many(self, ns: Namespace, group: int, chunks: Sequence[tuple[bytes, Optional[bytes]]],
                          nbytes: int) -> None:
        """Chunks of ``nbytes`` each, ``(key, parent)``, were renamed into place: journal them
        (parent, size and mtime) in one record batch and count their bytes as stored. Called by
        ``PageTransfer`` for a step's saves that published, on the thread that reaps them (the
        serving loop's): one native call finds their mtimes, one record batch journals them."""
        if not chunks:
            return
        at = time.time_ns()
        mtimes = ns.chunk_mtimes(group, [key for key, _ in chunks], nbytes)
        found = [(key, parent, mtime) for (key, parent), mtime in zip(chunks, mtimes) if mtime is not None]
        end: Optional[tuple[str, int]] = None
        if found:  # a chunk gone again (or replaced) by now has nothing to journal
            end = self.journal.append(chunk_records(PUBLISH, ns, group, [(key, parent) for key, parent, _ in found], nbytes,
                                                    np.array([m for _, _, m in found], dtype=np.int64), at))
        with self._state:
            for _ in chunks:
                self._unreserve(nbytes)
            # a count that read past these records has their bytes: they are not added twice
            if self._used is not None and not self._counted(end):
                self._used += nbytes * len(chunks)
            if self._counting:
                self._published_while_counting.append((end, nbytes * len(chunks)))

    def on_present(self, nbytes: int) -> None:
        """A save admitted (``admit_now``) found its chunk stored already and wrote nothing: its
        reservation ends. Called by ``PageTransfer`` when a native write reports the chunk present."""
        with self._state:
            self._unreserve(nbytes)

    def _unreserve(self, nbytes: int) -> None:
        """End one reservation of ``nbytes`` (caller holds ``_state``)."""
        for i, (_, n) in enumerate(self._inflight):
            if n == nbytes:
                del self._inflight[i]
                self._inflight_bytes -= n
                self._inflight_blocks -= self._blocks(n)
                return

    def on_touched(self, ns: Namespace, group: int, keys: Sequence[bytes], mtimes: Sequence[int], lease_until_ns: int) -> None:
        """A lookup set these chunks' mtime (recency) and lease: journal it, so that the index
        ranks them by their last use. Called by ``Namespace.lease_many``."""
        if keys:
            self.journal.append(records(TOUCH, ns.id, group, chunk_indexes(ns, group, keys),
                                        mtime=np.asarray(mtimes, dtype=np.int64), lease=lease_until_ns))

    def pin(self, path: str) -> None:
        """A load of ``path`` starts: the chunk is not evicted until ``unpin``. Called by
        ``PageTransfer._load``."""
        path = _norm(path)
        with self._state:
            self._pins[path] += 1

    def unpin(self, path: str) -> None:
        """The load of ``path`` finished (whatever its outcome)."""
        path = _norm(path)
        with self._state:
            self._pins[path] -= 1
            if self._pins[path] <= 0:
                del self._pins[path]

    # the index, off the serving path ----------------------------------------------------------
    def start_background(self) -> None:
        """Count the store from the index on a background thread, unless one is at it."""
        with self._state:
            if self._background is not None and self._background.is_alive():
                return
            self._counted_at = self.clock()  # one attempt per ``refresh_seconds``, even when it fails
            self._background = threading.Thread(target=self._background_run, name="gdskv-index", daemon=True)
            self._background.start()

    def _background_run(self) -> None:
        try:
            self.refresh()
        except Exception as e:  # a background thread of a server: log, never raise
            self._log_error(f"gdskv: could not read the chunk index of {self.store.root}: {e}")
        finally:
            self.counted.set()

    def refresh(self) -> Optional[catalog.Summary]:
        """Read the store's bytes from the index (a walk first when there is none, or when the
        last one is older than ``rewalk_seconds``; the index folded when its journals grew).
        Called on the background thread (``start_background``), and by tests."""
        summary = self._count(walk=True)
        if summary is None:
            return None
        if time.time_ns() - summary.walked_at_ns > self.rewalk_seconds * 1e9:
            rebuild_catalog(self.store)
        elif summary.journal_records >= self.compact_records:
            catalog.compact(self.store)
        return summary

    def _count(self, walk: bool) -> Optional[catalog.Summary]:
        """Set the byte count from the index; with ``walk``, walk the store first when it has
        no index (``rebuild_catalog``). None when there is no index (yet)."""
        with self._state:
            self._counting, self._published_while_counting = True, []
            evictions = self._evictions
        try:
            try:
                summary = catalog.totals(self.store)
            except catalog.CatalogMissing:
                if not walk or not rebuild_catalog(self.store):  # False: another process is walking it
                    return None
                summary = catalog.totals(self.store)
            with self._state:
                if (self._evictions == evictions and not self._removing) or self._used is None:
                    # chunks published while counting are in it where it read their journal records
                    self._counted_to = summary.journal_ends
                    self._used = summary.nbytes + sum(n for end, n in self._published_while_counting if not self._counted(end))
                    self._admitted_since_count = 0
                # else an eviction ran meanwhile and took its bytes off a count this one may predate
                # (or it is removing now, and takes off what this count may have read removed):
                # the next count (the next admission asks for one) settles it
            return summary
        finally:
            with self._state:
                self._counting = False

    def _counted(self, end: Optional[tuple[str, int]]) -> bool:
        """Whether the last count read a journal past ``end`` (``Journal.append``'s answer; None:
        not journaled, never counted). Caller holds ``_state``."""
        return end is not None and self._counted_to.get(end[0], 0) >= end[1]

    def _log_error(self, line: str) -> None:
        now = self.clock()
        if now - self._error_logged_at >= 60.0:  # at most one line a minute
            self._error_logged_at = now
            log.warning("%s", line)

    def _usage(self) -> tuple[int, int]:
        """The file system's ``(size, free)`` where the limits need it (a floor, or no count of the
        store yet), else ``(0, 0)``."""
        return self.disk_usage(str(self.store.root)) if self.limits.has_floor or self._used is None else (0, 0)

    def _need(self, nbytes: int, usage: Optional[tuple[int, int]] = None) -> int:
        """Bytes to free before ``nbytes`` more fit; ``usage``: ``_usage()`` when the caller asked
        already."""
        total, free = self._usage() if usage is None else usage
        used = self._used if self._used is not None else total - free  # the store is at most what the file system holds
        # saves in flight count as written, against the budget and against free space
        return shortfall(self.limits, used + self._inflight_bytes, total,
                         free - self._inflight_blocks * self._block, nbytes, self._block)

    def _try_reserve(self, nbytes: int, count: int = 1) -> int:
        """Count up to ``count`` chunks of ``nbytes`` as in flight, as many as fit (the file
        system asked once); how many. A reservation ends at ``on_published``, or after
        ``INFLIGHT_TTL_S`` (a save that failed after ``admit`` never publishes)."""
        with self._state:
            now = self.clock()
            while self._inflight and now - self._inflight[0][0] > INFLIGHT_TTL_S:
                n = self._inflight.popleft()[1]
                self._inflight_bytes -= n
                self._inflight_blocks -= self._blocks(n)
            usage = self._usage()
            taken = 0
            while taken < count and self._need(nbytes, usage) == 0:
                self._reserve(now, nbytes)
                self._admitted_since_count += nbytes
                taken += 1
            stale = self._stale(nbytes)
        if stale:
            self.start_background()  # read the index again: other processes took of the room it showed
        return taken

    def _stale(self, nbytes: int) -> bool:
        """Whether the last index read, plus ``nbytes`` more, is too old against a byte budget:
        other processes on the store fill the room it showed as well, so each reads the index
        again (on the background thread) once it admitted ``headroom`` of the budget (four
        chunks at least) since, instead of filling all of it (N processes filled N times the
        room: a store 4-9 times over its budget). The free-space floor needs no such bound: the
        file system's free space is asked on every admission."""
        if self.limits.max_bytes is None or self._used is None:
            return False
        allowance = max(int(self.headroom * self.limits.max_bytes), 4 * nbytes)
        return self._admitted_since_count + nbytes > allowance

    def _reserve(self, now: float, nbytes: int) -> None:
        """Count a save of ``nbytes`` as in flight from ``now`` (caller holds ``_state``)."""
        self._inflight.append((now, nbytes))
        self._inflight_bytes += nbytes
        self._inflight_blocks += self._blocks(nbytes)

    def _blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block)


def install_budget(store: PageStore, cfg: GdsKvConfig, wait_seconds: float = 0.5) -> Budget:
    """Set ``store.budget`` with the config's ``max_bytes`` / ``min_free_bytes`` /
    ``min_free_percent``, and return it. The store is counted from its chunk index on a
    background thread; with a limit, bring-up waits at most ``wait_seconds`` for that (an index is
    read in milliseconds; a store without one is walked meanwhile, saves held to the conservative
    estimate until the walk is done). Without a limit the budget admits every save and journals
    it all the same: a process that saved without journaling left its chunks out of
    ``gdskv info``, the metrics and every other process's budget until the daily walk.

    Called once at bring-up by the service (every process that writes chunks), the demo and
    ``gdskv pull``, right after ``PageStore.open``.
    """
    limits = Limits.of(cfg)
    if isinstance(store.budget, Budget) and store.budget.limits == limits:
        return store.budget
    budget = Budget(store, limits, refresh_seconds=REFRESH_S if limits.active else UNLIMITED_REFRESH_S)
    store.budget = budget
    budget.start_background()
    if limits.active:  # without a limit nothing waits on the count
        budget.counted.wait(wait_seconds)
    return budget
