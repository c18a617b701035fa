"""Eviction policy: plain data and pure functions, no I/O.

``ChunkTable`` (columns, built by ``gdskv.eviction.index.scan_store``) and ``ChunkInfo`` (rows) are
what the policy ranks. ``eviction_order`` ranks chunks, ``select_victims`` / ``pick_victims`` cut
the ranking at a byte count or an age, ``shortfall`` says how many bytes a save must free first
within ``Limits``. A chunk's *effective recency* is the newest mtime among it and every stored
descendant (chunks whose parent-key chain leads to it, same namespace and layer group); chunks go
in increasing effective recency, deeper first on ties. Every prefix of that order removes a block
only together with all of its stored descendants, so a stored block is never left without its
stored ancestors. Pinned chunks (and, through them, their ancestors) never go.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Iterable, Optional, Sequence

import numpy as np

from gdskv import format as fmt
from gdskv.config import GdsKvConfig

if TYPE_CHECKING:
    from gdskv.store import Namespace

NO_PARENT = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
"""Parent chunk index of a chunk without a parent (a chunk index has only 62 bits)."""
_PINNED = np.iinfo(np.int64).max


# --- plain data --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArrayRef:
    """One layer group's array of one namespace, and its directory (a ``ChunkTable`` row's array).
    ``namespace`` is None for an array whose namespace metadata is damaged (``PageStore.arrays``):
    its chunks are still ranked and removed, never served."""

    ns_id: str
    group: int
    path: str
    namespace: Optional[Namespace] = field(default=None, compare=False, repr=False)

    def chunk_file(self, index: int) -> str:
        """Path of the chunk file with chunk index ``index`` (``(hi << 50) | lo``)."""
        return f"{self.path}/{fmt.index_relpath(index >> fmt.LO_BITS, index & ((1 << fmt.LO_BITS) - 1))}"

    def chunk_rel(self, index: int) -> str:
        """The same file relative to the store root (what ``store.fs`` acts on)."""
        return f"ns/{self.ns_id}/g{int(self.group)}/{fmt.index_relpath(index >> fmt.LO_BITS, index & ((1 << fmt.LO_BITS) - 1))}"


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk, as the row-oriented policy API (``pick_victims``) takes it.

    ``index`` is the chunk's index in its array (``(hi << 50) | lo``, unique per array);
    ``parent`` the index of its parent block's chunk in the same array (``None`` for a root).
    """

    ns_id: str
    group: int
    index: int
    parent: Optional[int]
    nbytes: int
    mtime_ns: int
    path: str = ""


@dataclass
class ChunkTable:
    """Stored chunks in columns (one row per chunk file), built by ``scan_store``.

    ``parent`` holds the *row* of the parent chunk in this table, ``-1`` when the chunk has no
    parent or its parent is not stored (then it is a root of the forest the policy sees).
    """

    arrays: list[ArrayRef]
    array: np.ndarray  # int32: row → arrays[...]
    index: np.ndarray  # uint64: chunk index in its array
    parent: np.ndarray  # int64: row of the parent chunk, -1 none
    nbytes: np.ndarray  # int64: file size
    mtime_ns: np.ndarray  # int64: last use
    leased_until_ns: Optional[np.ndarray] = None  # int64: the file's atime, a lookup's lease (see ``Namespace.touch_many``)

    def __len__(self) -> int:
        return int(self.index.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def path(self, row: int) -> str:
        return self.arrays[int(self.array[row])].chunk_file(int(self.index[row]))

    def rows_of(self, paths: Iterable[str]) -> np.ndarray:
        """Rows of the chunk files named by ``paths`` (unknown paths are ignored). Called by
        ``Budget.admit`` to turn its pins into rows the policy leaves alone."""
        where = {_norm(a.path): i for i, a in enumerate(self.arrays)}
        wanted: dict[int, list[int]] = {}
        for p in paths:
            parsed = _parse_chunk_path(_norm(p))
            if parsed is not None and parsed[0] in where:
                wanted.setdefault(where[parsed[0]], []).append(parsed[1])
        mask = np.zeros(len(self), dtype=bool)
        for a, indexes in wanted.items():
            mask |= (self.array == a) & np.isin(self.index, np.array(indexes, dtype=np.uint64))
        return np.nonzero(mask)[0]

    def without(self, rows: Sequence[int]) -> "ChunkTable":
        """This table less ``rows``, parents renumbered (a parent left out makes its children
        roots). ``Budget.evict`` ranks again on it after removing ``rows``, rather than reading
        the whole index once more."""
        if not len(rows):
            return self
        keep = np.ones(len(self), dtype=bool)
        keep[np.asarray(rows, dtype=np.int64)] = False
        renumbered = np.cumsum(keep, dtype=np.int64) - 1
        renumbered[~keep] = -1
        parent = self.parent[keep]
        linked = parent >= 0
        parent[linked] = renumbered[parent[linked]]
        leased = None if self.leased_until_ns is None else self.leased_until_ns[keep]
        return ChunkTable(self.arrays, self.array[keep], self.index[keep], parent, self.nbytes[keep],
                          self.mtime_ns[keep], leased)

    @classmethod
    def from_chunks(cls, chunks: Sequence[ChunkInfo]) -> "ChunkTable":
        """Columns from rows (parents resolved within the same namespace and layer group)."""
        arrays: dict[tuple[str, int], int] = {}
        array = np.array([arrays.setdefault((c.ns_id, c.group), len(arrays)) for c in chunks], dtype=np.int32)
        row_of = {(int(array[i]), c.index): i for i, c in enumerate(chunks)}
        parent = np.array([-1 if c.parent is None else row_of.get((int(array[i]), c.parent), -1) for i, c in enumerate(chunks)], dtype=np.int64)
        refs = [ArrayRef(ns, g, "") for (ns, g) in arrays]
        return cls(refs, array, np.array([c.index for c in chunks], dtype=np.uint64), parent,
                   np.array([c.nbytes for c in chunks], dtype=np.int64), np.array([c.mtime_ns for c in chunks], dtype=np.int64))


# --- policy (pure) -----------------------------------------------------------------------------
def _forest(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, depth)``: ``parent`` with every link in a cycle (or leading into one) cut, and
    each row's number of stored ancestors.

    Trailers of honest chunks never form cycles (a parent's key is hashed from its own parent's);
    a corrupt or colliding chunk could, and the ranking must still terminate. Pointer jumping
    (depths summed on the way) reaches a root within 64 doublings on any forest; links still
    live after that are cyclic, and are cut (then the depths are counted again).
    """
    small = np.int32 if parent.size < (1 << 31) else np.int64  # half the memory traffic of the random gathers
    parent = np.where(parent == np.arange(parent.size), -1, parent).astype(small)
    for attempt in (0, 1):
        depth = (parent >= 0).astype(small)
        nxt = parent.copy()
        live = np.nonzero(nxt >= 0)[0]
        for _ in range(64):
            if live.size == 0:
                return parent.astype(np.int64), depth.astype(np.int64)
            up = nxt[live]
            depth[live] += depth[up]
            nxt[live] = nxt[up]
            live = live[nxt[live] >= 0]
        parent = np.where(nxt >= 0, -1, parent)
    raise AssertionError("a forest without cycles is resolved within 64 doublings")


def depths(parent: np.ndarray) -> np.ndarray:
    """Number of stored ancestors of each row (0 for a root) of a ``parent`` array, by pointer
    jumping: O(n log depth)."""
    return _forest(np.asarray(parent, dtype=np.int64))[1]


def effective_recency(parent: np.ndarray, mtime_ns: np.ndarray, pinned: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """``(eff, depth)``: each row's newest mtime over itself and its stored descendants, and its
    depth. Pinned rows (a boolean mask) count as used at +infinity, which carries to their
    ancestors: those are never ranked evictable."""
    parent, depth = _forest(np.asarray(parent, dtype=np.int64))
    eff = np.asarray(mtime_ns, dtype=np.int64).copy()
    if pinned is not None and pinned.any():
        eff[pinned] = _PINNED
    if depth.size and depth.max() > 0:
        top = int(depth.max())
        key = (top - depth).astype(np.uint16 if top < (1 << 16) else np.int64)  # small ints: a radix sort
        by_depth = np.argsort(key, kind="stable")
        bounds = np.r_[0, np.cumsum(np.bincount(key, minlength=top + 1))]
        # rows of depth max, max-1, ..., 1 in turn (roots, depth 0, have no parent to update)
        for level in range(top):
            rows = by_depth[bounds[level]:bounds[level + 1]]
            np.maximum.at(eff, parent[rows], eff[rows])
    return eff, depth


def eviction_order(parent: np.ndarray, mtime_ns: np.ndarray, pinned: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """``(order, eff)``: rows in the order they may be evicted — increasing effective recency,
    deeper first on ties — and every row's effective recency.

    Pinned rows and their ancestors are left out of ``order``. Any prefix of ``order`` is safe to
    remove: a row's stored descendants all come before it.
    """
    eff, depth = effective_recency(parent, mtime_ns, pinned)
    order = np.lexsort((-depth, eff))
    return order[eff[order] != _PINNED], eff


def _first_in_order(eff: np.ndarray, depth: np.ndarray, nbytes: np.ndarray, candidates: np.ndarray, bytes_to_free: int) -> np.ndarray:
    """The shortest prefix of ``eviction_order`` (restricted to ``candidates``) holding at least
    ``bytes_to_free`` bytes (all of them when they hold less), sorting only rows up to a
    threshold recency found by partition: a tenth of ten million rows sorts in a second, all of
    them in many."""
    if candidates.size == 0:
        return candidates
    k = min(candidates.size, max(1, int(bytes_to_free / max(1.0, float(nbytes[candidates].mean())) * 1.25) + 1))
    while True:
        if k >= candidates.size:
            pick = candidates
        else:
            cut = np.partition(eff[candidates], k - 1)[k - 1]
            pick = candidates[eff[candidates] <= cut]  # every row outside ranks after every row inside
        if k >= candidates.size or int(nbytes[pick].sum()) >= bytes_to_free:
            order = pick[np.lexsort((-depth[pick], eff[pick]))]
            cum = np.cumsum(nbytes[order])
            return order[: int(np.searchsorted(cum, bytes_to_free, side="left")) + 1]
        k *= 2


def select_victims(table: ChunkTable, bytes_to_free: Optional[int], pinned_rows: Collection[int] = (), older_than_ns: Optional[int] = None,
                   now_ns: Optional[int] = None) -> np.ndarray:
    """Rows to remove, in removal order (descendants first).

    ``bytes_to_free``: stop once at least this many bytes are chosen (``None``: no byte target,
    take everything eligible). ``older_than_ns``: only chunks whose effective recency (their own
    and every stored descendant's last use) is older than this wall-clock time in ns.
    ``now_ns``: chunks whose lease (``leased_until_ns``) runs past it are pinned, like
    ``pinned_rows``: a lookup promised them to an engine that has yet to load them.
    Called by ``Budget`` (inline, before a save) and by ``gdskv evict``.
    """
    pinned = np.zeros(len(table), dtype=bool)
    if len(pinned_rows):
        pinned[np.asarray(list(pinned_rows), dtype=np.int64)] = True
    mtime_ns = table.mtime_ns
    if now_ns is not None:
        if table.leased_until_ns is not None:
            pinned |= leased(table.leased_until_ns, now_ns)
        mtime_ns = ranked_mtimes(mtime_ns, now_ns)
    if bytes_to_free is not None and bytes_to_free <= 0:
        return np.zeros(0, dtype=np.int64)
    eff, depth = effective_recency(table.parent, mtime_ns, pinned)
    ok = eff != _PINNED
    if older_than_ns is not None:
        ok &= eff < older_than_ns
    candidates = np.nonzero(ok)[0]
    if bytes_to_free is None:
        return candidates[np.lexsort((-depth[candidates], eff[candidates]))]
    return _first_in_order(eff, depth, table.nbytes, candidates, bytes_to_free)


def pick_victims(chunks: Sequence[ChunkInfo], bytes_to_free: Optional[int], pinned: Collection[str] = (), older_than_ns: Optional[int] = None) -> list[ChunkInfo]:
    """Row-oriented ``select_victims``: the chunks to remove, in removal order.

    ``pinned`` holds the ``path`` of chunks being read or written.
    """
    table = ChunkTable.from_chunks(chunks)
    pins = set(pinned)
    rows = [i for i, c in enumerate(chunks) if c.path and c.path in pins]
    return [chunks[int(i)] for i in select_victims(table, bytes_to_free, rows, older_than_ns)]


@dataclass(frozen=True)
class Limits:
    """A store's capacity limits: a byte budget and a free-space floor (either may be absent)."""

    max_bytes: Optional[int] = None
    min_free_bytes: Optional[int] = None
    min_free_percent: Optional[float] = None

    @classmethod
    def of(cls, cfg: GdsKvConfig) -> "Limits":
        """The limits gdskv's config sets (``install_budget``, ``gdskv info`` / ``evict``)."""
        return cls(cfg.max_bytes, cfg.min_free_bytes, cfg.min_free_percent)

    @property
    def has_floor(self) -> bool:
        return self.min_free_bytes is not None or self.min_free_percent is not None

    @property
    def active(self) -> bool:
        return self.max_bytes is not None or self.has_floor

    def floor_bytes(self, fs_total: int) -> int:
        """Bytes that must stay free on the file system."""
        pct = 0 if self.min_free_percent is None else int(fs_total * self.min_free_percent / 100)
        return max(self.min_free_bytes or 0, pct)


MAX_LEASE_NS = 3600 * 10**9
"""The furthest ahead a lease (a chunk's atime) is honoured: leases run ``lease_seconds`` (30 s)
past a lookup, so an atime further ahead is a clock that ran ahead or a copy that kept times
(``cp -a``), and would pin the chunk for as long."""


def leased(leased_until_ns: Any, now_ns: int) -> Any:
    """Whether a chunk whose atime is ``leased_until_ns`` (a number or an array) is under a
    lookup's lease at ``now_ns``: ahead of it, by at most ``MAX_LEASE_NS``. Eviction's rule,
    when it ranks (``select_victims``) and when it removes (``remove_chunks``)."""
    return (leased_until_ns > now_ns) & (leased_until_ns <= now_ns + MAX_LEASE_NS)


def ranked_mtimes(mtime_ns: np.ndarray, now_ns: int) -> np.ndarray:
    """The mtimes eviction ranks by: one a little ahead of ``now_ns`` (clocks of writers that
    differ) as ``now_ns``, one further ahead than ``MAX_LEASE_NS`` as unknown, 0: a clock that
    ran years ahead must not keep a chain in the store for years."""
    mtime_ns = np.asarray(mtime_ns, dtype=np.int64)
    return np.where(mtime_ns > now_ns + MAX_LEASE_NS, 0, np.minimum(mtime_ns, now_ns))


def no_room(limits: Limits, fs_total: int, page_bytes: int) -> Optional[str]:
    """Why ``limits`` leave no room for a single chunk of ``page_bytes`` (plus its trailer) on a
    file system of ``fs_total`` bytes, so that every save would be dropped; None when one fits.
    The service logs it at bring-up (``KvService``): a typo in a size should not look like a
    cache that never hits."""
    chunk = page_bytes + fmt.TRAILER_BYTES
    if limits.max_bytes is not None and limits.max_bytes < chunk:
        return f"max_bytes {limits.max_bytes} is less than one chunk ({chunk} bytes)"
    if limits.has_floor and limits.floor_bytes(fs_total) + chunk > fs_total:
        return (f"the free-space floor (min_free_bytes / min_free_percent: {limits.floor_bytes(fs_total)} bytes) "
                f"leaves no room for a chunk on a file system of {fs_total} bytes")
    return None


def shortfall(limits: Limits, used: int, fs_total: int, fs_free: int, incoming: int = 0, block: int = 1) -> int:
    """Bytes that must be freed before ``incoming`` more bytes can be stored within ``limits``
    (0 when they fit). ``used``: bytes of the store's chunks; ``fs_*``: the file system's size and
    free space; ``block``: its allocation unit — against the free-space floor a file takes whole
    blocks (a 1 MiB + 128 B chunk takes 257 blocks of 4 KiB, not 1 MiB + 128 B)."""
    need = 0
    if limits.max_bytes is not None:
        need = used + incoming - limits.max_bytes
    if limits.has_floor:
        allocated = -(-incoming // block) * block
        need = max(need, limits.floor_bytes(fs_total) - (fs_free - allocated))
    return max(need, 0)


# --- chunk paths (string work only) ------------------------------------------------------------
def _parse_chunk_path(path: str) -> Optional[tuple[str, int]]:
    """``(array dir, chunk index)`` of a chunk file path, or None for anything else."""
    parts = str(path).rsplit("/", 4)
    if len(parts) != 5 or parts[1] != "c" or parts[3] != "0" or not parts[2].isdigit() or not parts[4].isdigit():
        return None
    return parts[0], (int(parts[2]) << fmt.LO_BITS) | int(parts[4])



def _norm(path: str) -> str:
    """``path`` made absolute (a store opened through a relative path names its chunks relatively)."""
    path = os.fspath(path)
    return path if path.startswith("/") else os.path.abspath(path)
