"""Capacity-bounded, prefix-aware, recency-based eviction (FORMAT.md, "Capacity, recency and eviction",
is the prose version).

Three layers, each usable on its own:

- **Policy** — pure functions over plain data (``ChunkTable`` columns, or a list of ``ChunkInfo``):
  ``eviction_order`` ranks chunks, ``select_victims`` / ``pick_victims`` cut the ranking at a byte
  count or an age, ``shortfall`` says how many bytes a save must free first. A chunk's
  *effective recency* is the newest mtime among it and every stored descendant (chunks whose
  parent-key chain leads to it, same namespace and layer group); chunks go in increasing effective
  recency, deeper first on ties. Every prefix of that order removes a block only together with all
  of its stored descendants, so a stored block is never left without its stored ancestors. Pinned
  chunks (and, through them, their ancestors) never go.
- **Index** — ``scan_store`` lists the chunk files through the store's one walker
  (``PageStore.arrays`` / ``chunk_entries``: real directories only, never a link) and attaches
  each chunk's parent. Only regular files named by their chunk index are chunks; links, FIFOs and
  other entries are never opened, counted or removed. Every array on disk is scanned, those of
  namespaces with damaged metadata too (their chunks use space and stay evictable). Parents come
  from the chunk trailers, cached per array under ``<root>/.gdskv/index/`` (``<ns_id>.g<gid>.npy``:
  chunk index, inode, parent chunk index), so a trailer is read once per chunk file, not once per
  scan.
- **Removal** — ``remove_chunks``: every file operation goes through ``store.fs`` (confined to the
  store's root). A chunk is renamed to a doomed temp name first, then removed only if no lease
  landed on it before the rename (a lease after it fails, so the lookup promises nothing).
- **Budget** — ``Budget`` implements the hook ``PageTransfer`` calls on ``store.budget``
  (``admit`` / ``on_published`` / ``pin`` / ``unpin``); ``install_budget(store, cfg)`` sets it at
  bring-up when the config has a byte budget or a free-space floor.

Recency is the chunk file's mtime: loads (``PageTransfer``) and lookups (``Namespace.touch_many``)
refresh it, so it survives restarts and is shared by every process on the store. Callers: the
connectors and the demo (``install_budget`` at bring-up), ``PageTransfer`` (the hook), and
``gdskv evict`` / ``gdskv info`` / ``gdskv ls`` (``scan_store``, ``select_victims``,
``remove_chunks``).
"""
from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import secrets
import shutil
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Optional, Sequence

import numpy as np

from gdskv import format as fmt
from gdskv.config import GdsKvConfig
from gdskv.keys import store_key
from gdskv.store import PRIVATE_DIR, Namespace, PageStore

log = logging.getLogger(__name__)

NO_PARENT = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
"""Parent chunk index of a chunk without a parent (a chunk index has only 62 bits)."""
INDEX_DIR = "index"
_CACHE_DTYPE = np.dtype([("index", "<u8"), ("ino", "<u8"), ("parent", "<u8")])
_PINNED = np.iinfo(np.int64).max
INFLIGHT_TTL_S = 60.0
"""How long ``Budget`` counts an admitted save that has not published (it may have failed)."""


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
def _break_cycles(parent: np.ndarray) -> np.ndarray:
    """``parent`` with every link in a cycle (or leading into one) cut.

    Trailers of honest chunks never form cycles (a parent's key is hashed from its own parent's);
    a corrupt or colliding chunk could, and the ranking must still terminate. Pointer jumping
    reaches a root within 64 doublings on any forest; links still live after that are cyclic.
    """
    parent = np.where(parent == np.arange(parent.size), -1, parent)
    nxt = parent.copy()
    for _ in range(64):
        live = np.nonzero(nxt >= 0)[0]
        if live.size == 0:
            return parent
        nxt[live] = nxt[nxt[live]]
    return np.where(nxt >= 0, -1, parent)


def depths(parent: np.ndarray) -> np.ndarray:
    """Number of stored ancestors of each row (0 for a root) of an acyclic ``parent`` array,
    by pointer jumping: O(n log depth)."""
    depth = (parent >= 0).astype(np.int64)
    nxt = parent.copy()
    while True:
        live = np.nonzero(nxt >= 0)[0]
        if live.size == 0:
            return depth
        up = nxt[live]
        depth[live] += depth[up]
        nxt[live] = nxt[up]


def effective_recency(parent: np.ndarray, mtime_ns: np.ndarray, pinned: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """``(eff, depth)``: each row's newest mtime over itself and its stored descendants, and its
    depth. Pinned rows (a boolean mask) count as used at +infinity, which carries to their
    ancestors: those are never ranked evictable."""
    parent = _break_cycles(np.asarray(parent, dtype=np.int64))
    depth = depths(parent)
    eff = np.asarray(mtime_ns, dtype=np.int64).copy()
    if pinned is not None and pinned.any():
        eff[pinned] = _PINNED
    if depth.size:
        by_depth = np.argsort(-depth, kind="stable")
        # row ranges of depth max, max-1, ..., 1 (roots, depth 0, have no parent to update)
        bounds = np.searchsorted(-depth[by_depth], np.arange(-int(depth.max()), 1), side="left")
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            rows = by_depth[lo:hi]
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
    if now_ns is not None and table.leased_until_ns is not None:
        pinned |= table.leased_until_ns > now_ns
    order, eff = eviction_order(table.parent, table.mtime_ns, pinned)
    if older_than_ns is not None:
        order = order[eff[order] < older_than_ns]
    if bytes_to_free is not None:
        if bytes_to_free <= 0:
            return order[:0]
        cum = np.cumsum(table.nbytes[order])
        order = order[: int(np.searchsorted(cum, bytes_to_free, side="left")) + 1]
    return order


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


# --- index -------------------------------------------------------------------------------------
def _parse_chunk_path(path: str) -> Optional[tuple[str, int]]:
    """``(array dir, chunk index)`` of a chunk file path, or None for anything else."""
    parts = str(path).rsplit("/", 4)
    if len(parts) != 5 or parts[1] != "c" or parts[3] != "0" or not parts[2].isdigit() or not parts[4].isdigit():
        return None
    return parts[0], (int(parts[2]) << fmt.LO_BITS) | int(parts[4])


def chunk_index_of(ns_id: str, group: int, key: bytes) -> int:
    """The chunk index (``(hi << 50) | lo``) of block ``key`` in a namespace's layer group."""
    hi, lo = fmt.chunk_index(store_key(ns_id, group, key))
    return (hi << fmt.LO_BITS) | lo


def _norm(path: str) -> str:
    """``path`` made absolute (a store opened through a relative path names its chunks relatively)."""
    path = os.fspath(path)
    return path if path.startswith("/") else os.path.abspath(path)


def _arrays(store: PageStore, namespaces: Optional[Sequence[Namespace | str]]) -> list[ArrayRef]:
    """The arrays to scan: every array directory on disk (``PageStore.arrays``, damaged namespaces
    included), or those of ``namespaces`` (``Namespace`` objects or namespace ids)."""
    want = None if namespaces is None else {n if isinstance(n, str) else n.id for n in namespaces}
    return [ArrayRef(a.ns_id, a.group, a.path, a.namespace) for a in store.arrays() if want is None or a.ns_id in want]


_MAX_HI = 1 << fmt.HI_BITS
_MAX_LO = 1 << fmt.LO_BITS


def _walk_array(store: PageStore, ref: ArrayRef) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(index, inode, size, mtime_ns, atime_ns) of every published chunk file of an array, from
    the store's walker (``PageStore.chunk_entries``: links are never followed). A chunk is a
    regular file named by its index, exactly as ``chunk_file`` spells it; temp files, links,
    FIFOs, directories and odd names are not chunks: never counted, opened or removed. Called by
    ``scan_store`` per array; an entry removed meanwhile (``gc``, another process's eviction) is
    skipped, so a scan on a transfer thread never raises for it."""
    idx: list[int] = []
    ino: list[int] = []
    size: list[int] = []
    mtime: list[int] = []
    atime: list[int] = []
    for e in store.chunk_entries(ref):
        if e.kind != "file" or e.lo is None or e.st is None:
            continue
        hi, lo = e.hi, e.lo
        if not (0 <= hi < _MAX_HI and 0 <= lo < _MAX_LO) or e.name != str(lo) or not e.path.endswith(f"/c/{hi}/0/{lo}"):
            continue  # "007", "٣", 2**60: the chunk path would name another file
        st = e.st
        idx.append((hi << fmt.LO_BITS) | lo)
        ino.append(st.st_ino)
        size.append(st.st_size)
        mtime.append(st.st_mtime_ns)
        atime.append(st.st_atime_ns)
    return idx, ino, size, mtime, atime


def read_trailer(store: PageStore, path: str) -> Optional[fmt.Trailer]:
    """The trailer of the chunk file at ``path`` (inside the store), or None when it is gone, is
    not a regular file (a FIFO is refused at once, never waited on) or does not parse. Called by
    the index (a chunk's parent) and by ``gdskv ls`` (its keys)."""
    try:
        fd = store.fs.open_regular(path)
    except (OSError, ValueError):
        return None
    try:
        size = os.fstat(fd).st_size
        if size < fmt.TRAILER_BYTES:
            return None
        return fmt.unpack(os.pread(fd, fmt.TRAILER_BYTES, size - fmt.TRAILER_BYTES))
    except (OSError, fmt.ChunkFormatError):
        return None
    finally:
        os.close(fd)


def _read_parent(store: PageStore, ref: ArrayRef, index: int) -> int:
    """Parent chunk index from the chunk's trailer (``NO_PARENT`` for a root or a bad trailer)."""
    t = read_trailer(store, ref.chunk_rel(index))
    if t is None or t.parent_key is None or t.layer_group != ref.group:
        return int(NO_PARENT)
    return chunk_index_of(ref.ns_id, ref.group, t.parent_key)  # ``unpack`` checked the key's length


def _cache_path(ref: ArrayRef) -> str:
    """The array's parent-index cache, relative to the store root (``ArrayRef`` ids come from
    ``PageStore.arrays``: 16 hex digits and a decimal group)."""
    return f"{PRIVATE_DIR}/{INDEX_DIR}/{ref.ns_id}.g{int(ref.group)}.npy"


_CACHE_LIMIT = 1 << 31


def _load_cache(store: PageStore, path: str) -> np.ndarray:
    """The cached index at ``path`` (empty when missing, not a regular file, or not one)."""
    try:
        arr = np.load(io.BytesIO(store.fs.read_small(path, limit=_CACHE_LIMIT)), allow_pickle=False)
        if arr.dtype == _CACHE_DTYPE and arr.ndim == 1:
            return arr
    except (OSError, ValueError, EOFError):
        pass
    return np.zeros(0, dtype=_CACHE_DTYPE)


def _save_cache(store: PageStore, path: str, arr: np.ndarray) -> None:
    """Write atomically through ``store.fs`` (temp name that ``gdskv gc`` knows, then rename);
    failures only log."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    try:
        store.fs.write_atomic(path, buf.getvalue(), f"{fmt.TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    except OSError as e:
        log.warning("gdskv: could not write eviction index %s: %s", path, e)


def _array_parents(store: PageStore, ref: ArrayRef, idx: np.ndarray, ino: np.ndarray, known: dict[int, int]) -> np.ndarray:
    """Parent chunk index of each scanned chunk: from the cache when the inode matches, else from
    ``known`` (published by this process) or the trailer; the cache is rewritten when it changed."""
    path = _cache_path(ref)
    cache = _load_cache(store, path)
    parent = np.full(idx.size, NO_PARENT, dtype=np.uint64)
    hit = np.zeros(idx.size, dtype=bool)
    if cache.size and idx.size:
        pos = np.minimum(np.searchsorted(cache["index"], idx), cache.size - 1)
        hit = (cache["index"][pos] == idx) & (cache["ino"][pos] == ino)
        parent[hit] = cache["parent"][pos[hit]]
    miss = np.nonzero(~hit)[0]
    for i in miss.tolist():
        k = int(idx[i])
        parent[i] = known[k] if k in known else _read_parent(store, ref, k)
    if miss.size or int(hit.sum()) != cache.size:
        fresh = np.empty(idx.size, dtype=_CACHE_DTYPE)
        fresh["index"], fresh["ino"], fresh["parent"] = idx, ino, parent
        fresh.sort(order="index")
        _save_cache(store, path, fresh)
    return parent


def scan_store(
    store: PageStore,
    namespaces: Optional[Sequence[Namespace | str]] = None,
    with_parents: bool = True,
    known_parents: Optional[dict[tuple[str, int], dict[int, int]]] = None,
) -> ChunkTable:
    """Every published chunk of ``namespaces`` (``Namespace`` objects or ids; default: every
    array on disk, damaged namespaces included) as a ``ChunkTable``.

    One scandir per directory and one stat per chunk file (the store's walker). With
    ``with_parents`` the parent links are attached from the index cache (a trailer is read only
    for chunk files the cache has not seen); without, every ``parent`` is -1 (enough for sizes
    and listings). ``known_parents[(ns_id, group)][chunk index]`` supplies parents this process
    already knows. Called by ``Budget`` and by ``gdskv evict`` / ``info`` / ``ls``.
    """
    arrays: list[ArrayRef] = []
    cols: list[tuple[np.ndarray, ...]] = []
    for ref in _arrays(store, namespaces):
        idx_l, ino_l, size_l, mtime_l, atime_l = _walk_array(store, ref)
        idx = np.array(idx_l, dtype=np.uint64)
        ino = np.array(ino_l, dtype=np.uint64)
        if with_parents:
            parent_idx = _array_parents(store, ref, idx, ino, (known_parents or {}).get((ref.ns_id, ref.group), {}))
        else:
            parent_idx = np.full(idx.size, NO_PARENT, dtype=np.uint64)
        arrays.append(ref)
        cols.append((idx, parent_idx, np.array(size_l, dtype=np.int64), np.array(mtime_l, dtype=np.int64),
                     np.array(atime_l, dtype=np.int64)))
    if not cols:
        empty_i = np.zeros(0, dtype=np.int64)
        return ChunkTable(arrays, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint64), empty_i, empty_i, empty_i, empty_i)
    parent_rows = []
    offset = 0
    for idx, parent_idx, *_ in cols:
        rows = np.full(idx.size, -1, dtype=np.int64)
        if idx.size:
            order = np.argsort(idx)
            pos = np.minimum(np.searchsorted(idx, parent_idx, sorter=order), idx.size - 1)
            found = (idx[order[pos]] == parent_idx) & (parent_idx != NO_PARENT)
            rows[found] = offset + order[pos[found]]
        parent_rows.append(rows)
        offset += idx.size
    return ChunkTable(
        arrays,
        np.concatenate([np.full(c[0].size, i, dtype=np.int32) for i, c in enumerate(cols)]),
        np.concatenate([c[0] for c in cols]),
        np.concatenate(parent_rows),
        np.concatenate([c[2] for c in cols]),
        np.concatenate([c[3] for c in cols]),
        np.concatenate([c[4] for c in cols]),
    )


def namespace_ids_matching(store: PageStore, wanted: str) -> list[str]:
    """Ids of the namespaces on disk (damaged ones included) whose id starts with ``wanted`` or
    whose model is ``wanted``. Called by ``gdskv evict`` / ``ls`` for ``--namespace``."""
    out = [ns.id for ns in store.namespaces() if ns.id.startswith(wanted) or ns.spec.model == wanted]
    return out + [ns_id for ns_id, _ in store.damaged_namespaces() if ns_id.startswith(wanted) and ns_id not in out]


# --- removal -----------------------------------------------------------------------------------
@dataclass
class Removal:
    """What ``remove_chunks`` did. ``freed_bytes`` includes chunks another process removed first.
    ``skipped_leased``: chunks a lookup leased after the scan (kept, with their ancestors)."""

    removed: int = 0
    removed_bytes: int = 0
    skipped_pinned: int = 0
    already_gone: int = 0
    freed_bytes: int = 0
    failed: int = 0
    skipped_leased: int = 0


_doomed_seq = itertools.count()


def _doomed_name(rel: str) -> str:
    """A temp name beside the chunk for its last moment: ``<lo>.tmp.<pid>.evict<n>``, which
    ``gdskv gc`` collects as this process's temp file should it die right here."""
    return f"{rel}{fmt.TMP_MARK}{os.getpid()}.evict{next(_doomed_seq)}"


def remove_chunk(store: PageStore, rel: str) -> str:
    """Remove one chunk file unless a lease vetoes it; ``"removed"``, ``"gone"``, ``"leased"`` or
    ``"failed"``. Every step goes through ``store.fs`` (a link is moved or removed as itself).

    The chunk is first renamed to a doomed temp name in its own directory, so no lease can land
    on it by name any more (``Namespace.lease_many`` then fails, and the lookup promises nothing),
    then ``lstat``-ed: an atime in the future means a lease landed before the rename, and the
    chunk goes back under its name (``link_noreplace``: a chunk published there meanwhile wins)
    and stays. Called by ``remove_chunks``."""
    fs = store.fs
    doomed = _doomed_name(rel)
    try:
        fs.rename(rel, doomed)
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        log.warning("gdskv: could not evict %s: %s", fs.abspath(fs.rel(rel)), e)
        return "failed"
    try:
        st = fs.lstat(doomed)
    except FileNotFoundError:  # another process's gc or eviction took it
        return "gone"
    except OSError as e:
        st = None
        log.warning("gdskv: could not check the lease of %s: %s", fs.abspath(fs.rel(rel)), e)
    try:
        if st is None or st.st_atime_ns > time.time_ns():  # leased (or unknown): put it back
            try:
                fs.link_noreplace(doomed, rel)
            except FileExistsError:  # a save published the block again meanwhile: that one stays
                pass
            except OSError:
                fs.rename(doomed, rel)
                return "leased"
            fs.unlink(doomed)
            return "leased"
        fs.unlink(doomed)
        return "removed"
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        log.warning("gdskv: could not finish evicting %s (left as %s): %s", fs.abspath(fs.rel(rel)), doomed, e)
        return "failed"


def remove_chunks(store: PageStore, table: ChunkTable, rows: Sequence[int],
                  is_pinned: Callable[[str], bool] = lambda path: False, lock: Optional[threading.Lock] = None) -> Removal:
    """Remove the chunk files of ``rows`` in the order given (descendants first, as ranked).

    A row whose file became pinned after it was chosen is kept, and so are its ancestors (they
    come later in ``rows``); so is one a lookup leased after the scan (``remove_chunk``).
    ``is_pinned`` is checked and the file removed under ``lock`` (the lock ``Budget.pin``
    takes), so a load either keeps its chunk or finds it gone (a miss). Counts ``evicted`` /
    ``evicted_bytes`` on the chunk's namespace (none for a damaged one). Called by ``Budget``
    and ``gdskv evict``.
    """
    out = Removal()
    keep: set[int] = set()
    counted: dict[str, Optional[Namespace]] = {}
    for row in (int(r) for r in rows):
        if row in keep:
            out.skipped_pinned += 1
            continue
        ref = table.arrays[int(table.array[row])]
        index = int(table.index[row])
        nbytes = int(table.nbytes[row])
        with lock or contextlib.nullcontext():
            status = "pinned" if is_pinned(ref.chunk_file(index)) else remove_chunk(store, ref.chunk_rel(index))
        if status in ("pinned", "leased"):
            if status == "pinned":
                out.skipped_pinned += 1
            else:
                out.skipped_leased += 1
            up = int(table.parent[row])
            while up >= 0 and up not in keep:
                keep.add(up)
                up = int(table.parent[up])
        elif status == "failed":
            out.failed += 1
        elif status == "gone":
            out.already_gone += 1
            out.freed_bytes += nbytes
        else:
            out.removed += 1
            out.removed_bytes += nbytes
            out.freed_bytes += nbytes
            if ref.ns_id not in counted:
                counted[ref.ns_id] = _counting_namespace(store, ref)
            ns = counted[ref.ns_id]
            if ns is not None:
                ns.counters.add("evicted")
                ns.counters.add("evicted_bytes", nbytes)
    return out


def _counting_namespace(store: PageStore, ref: ArrayRef) -> Optional[Namespace]:
    """The registered namespace of ``ref`` (so ``flush_stats`` writes its counts); None for a
    damaged namespace or when it cannot be registered."""
    if ref.namespace is None:
        return None
    try:
        return store.namespace(ref.namespace.spec)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("gdskv: eviction counts of namespace %s are not kept: %s", ref.ns_id, e)
        return None


# --- the store hook ----------------------------------------------------------------------------
DiskUsage = Callable[[str], tuple[int, int]]


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

    ``admit`` before every save (after the chunk was found absent), ``on_published`` after the
    rename, ``pin``/``unpin`` around every load. The store's chunk bytes are estimated between
    scans (scan result + bytes admitted since); a scan happens when the estimate says a save does
    not fit, and at least every ``rescan_seconds`` so that other processes' writes are seen. An
    eviction frees what the save needs plus ``headroom`` (a fraction of the budget, or of the
    floor when only a floor is set), so one scan serves many saves. A save that does not fit
    while another thread evicts waits at most ``max_wait_seconds`` for it, then is dropped.
    ``disk_usage``, ``clock`` and ``block_size`` (the allocation unit the floor counts in) are
    injectable for tests.
    """

    def __init__(self, store: PageStore, limits: Limits, headroom: float = 0.05, rescan_seconds: float = 300.0,
                 max_wait_seconds: float = 2.0, disk_usage: DiskUsage = disk_usage, clock: Callable[[], float] = time.monotonic,
                 block_size: Optional[int] = None) -> None:
        self.store = store
        self.limits = limits
        self.headroom = headroom
        self.rescan_seconds = rescan_seconds
        self.max_wait_seconds = max_wait_seconds
        self.disk_usage = disk_usage
        self.clock = clock
        self._used: Optional[int] = None  # chunk bytes on disk: last scan + published since
        self._inflight: deque[tuple[float, int]] = deque()  # (admitted at, bytes) not yet published
        self._inflight_bytes = 0
        self._inflight_blocks = 0  # the same saves in the file system's allocation units
        self._block = block_size or _allocation_unit(str(store.root))
        self._scanning = False
        self._published_while_scanning = 0
        self._scanned_at = float("-inf")
        self._state = threading.Lock()  # guards the fields below; held for microseconds
        self._evicting = threading.Lock()  # one scan / eviction at a time
        self._pins: Counter[str] = Counter()
        self._known: dict[tuple[str, int], dict[int, int]] = {}
        self._error_logged_at = float("-inf")

    @property
    def used_bytes(self) -> Optional[int]:
        """The current estimate of the store's chunk bytes, saves in flight included (None before
        the first scan)."""
        return None if self._used is None else self._used + self._inflight_bytes

    # hook -------------------------------------------------------------------------------------
    def admit(self, ns: Namespace, group: int, nbytes: int, parent: Optional[bytes] = None) -> bool:
        """May a chunk of ``nbytes`` be written now? Evicts first when it would cross a limit;
        False (the caller drops and counts the save) when not enough can be evicted, e.g.
        because everything left is pinned. The chunk's ``parent`` block (and so its ancestors)
        is not evicted to make room for it, and nothing is evicted for a chunk whose parent is
        not stored: either would leave the new chunk unservable. Never raises: a scan or an
        eviction that fails (I/O error, bad metadata) drops the save, with a log line and the
        namespace's ``eviction_errors`` counter.
        Called by ``PageTransfer._save`` on a transfer thread, never on the serving loop."""
        try:
            return self._admit(ns, group, nbytes, parent)
        except (OSError, ValueError) as e:
            ns.counters.add("eviction_errors")
            now = self.clock()
            if now - self._error_logged_at >= 60.0:  # at most one line a minute
                self._error_logged_at = now
                log.warning("gdskv: eviction in %s failed, save dropped: %s", self.store.root, e)
            return False

    def _admit(self, ns: Namespace, group: int, nbytes: int, parent: Optional[bytes]) -> bool:
        stale = self._used is None or self.clock() - self._scanned_at > self.rescan_seconds
        if stale and self._evicting.acquire(blocking=self._used is None):
            try:
                self.refresh()
            finally:
                self._evicting.release()
        if self._try_reserve(nbytes):
            return True
        if not self._evicting.acquire(timeout=self.max_wait_seconds):
            return False  # another thread is still making room: a late save is worth less than a free thread
        try:
            if self._try_reserve(nbytes):  # another thread evicted meanwhile
                return True
            if parent is not None and not ns.contains(group, parent):
                return False  # the chunk would be unservable: not worth evicting anything for
            table = self.refresh()
            need = self._need(nbytes)
            if need > 0:
                base = self.limits.max_bytes or self.limits.floor_bytes(self.disk_usage(str(self.store.root))[0])
                with self._state:
                    protect = list(self._pins) + ([ns.chunk_path(group, parent)] if parent is not None else [])
                pinned = table.rows_of(protect)
                rows = select_victims(table, need + int(self.headroom * base), pinned, now_ns=time.time_ns())
                done = remove_chunks(self.store, table, rows, lambda p: self._pins[_norm(p)] > 0, self._state)
                with self._state:
                    self._used = max(0, (self._used or 0) - done.freed_bytes)
                if done.removed:
                    log.info("gdskv: evicted %d chunks (%d bytes) to stay within %s", done.removed, done.removed_bytes, self.limits)
            return self._try_reserve(nbytes)
        finally:
            self._evicting.release()

    def on_published(self, ns: Namespace, group: int, key: bytes, parent: Optional[bytes], nbytes: int) -> None:
        """A chunk was renamed into place: remember its parent so the next scan does not read its
        trailer (its bytes were counted by ``admit``). Called by ``PageTransfer._save``."""
        p = int(NO_PARENT) if parent is None else chunk_index_of(ns.id, group, parent)
        with self._state:
            self._known.setdefault((ns.id, group), {})[chunk_index_of(ns.id, group, key)] = p
            for i, (_, n) in enumerate(self._inflight):
                if n == nbytes:
                    del self._inflight[i]
                    self._inflight_bytes -= n
                    self._inflight_blocks -= self._blocks(n)
                    break
            self._used = (self._used or 0) + nbytes
            if self._scanning:
                self._published_while_scanning += nbytes

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

    # internals --------------------------------------------------------------------------------
    def refresh(self) -> ChunkTable:
        """Rescan the store: the byte count, and the table the policy ranks. Called by ``admit``
        (when the estimate is stale or a save does not fit) and once by ``install_budget``."""
        with self._state:
            known = {k: dict(v) for k, v in self._known.items()}
            self._scanning, self._published_while_scanning = True, 0
        try:
            table = scan_store(self.store, known_parents=known)
        finally:
            with self._state:
                self._scanning = False
        with self._state:
            # a chunk published during the walk may or may not have been seen: count it (safe side)
            self._used = table.total_bytes + self._published_while_scanning
            self._scanned_at = self.clock()
            for k, v in known.items():  # now in the index cache
                for idx in v:
                    self._known.get(k, {}).pop(idx, None)
        return table

    def _need(self, nbytes: int) -> int:
        total, free = self.disk_usage(str(self.store.root)) if self.limits.has_floor else (0, 0)
        # saves in flight count as written, against the budget and against free space
        return shortfall(self.limits, (self._used or 0) + self._inflight_bytes, total,
                         free - self._inflight_blocks * self._block, nbytes, self._block)

    def _try_reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` as in flight if they fit. A reservation ends at ``on_published``, or
        after ``INFLIGHT_TTL_S`` (a save that failed after ``admit`` never publishes)."""
        with self._state:
            now = self.clock()
            while self._inflight and now - self._inflight[0][0] > INFLIGHT_TTL_S:
                n = self._inflight.popleft()[1]
                self._inflight_bytes -= n
                self._inflight_blocks -= self._blocks(n)
            if self._need(nbytes) > 0:
                return False
            self._inflight.append((now, nbytes))
            self._inflight_bytes += nbytes
            self._inflight_blocks += self._blocks(nbytes)
            return True

    def _blocks(self, nbytes: int) -> int:
        return -(-nbytes // self._block)


def install_budget(store: PageStore, cfg: GdsKvConfig) -> Optional[Budget]:
    """Set ``store.budget`` from the config's ``max_bytes`` / ``min_free_bytes`` /
    ``min_free_percent`` when any is set (scanning the store once), and return it; else None.

    Called once at bring-up by the connectors and the demo, right after ``PageStore.open``.
    """
    limits = Limits.of(cfg)
    if not limits.active:
        return None
    if isinstance(store.budget, Budget) and store.budget.limits == limits:
        return store.budget
    budget = Budget(store, limits)
    try:
        budget.refresh()
    except (OSError, ValueError) as e:  # bring-up goes on; the first ``admit`` scans again
        log.warning("gdskv: could not scan %s for its byte budget: %s", store.root, e)
    store.budget = budget
    return budget
