"""Eviction index: the store's chunks as a ``ChunkTable``, with their parents.

``scan_store`` lists the chunk files through the store's one walker (``PageStore.arrays`` /
``chunk_entries``: real directories only, never a link) and attaches each chunk's parent. Only
regular files named by their chunk index are chunks; links, FIFOs and other entries are never
opened, counted or removed. Every array on disk is scanned, those of namespaces with damaged
metadata too (their chunks use space and stay evictable). Parents come from the chunk trailers,
cached per array under ``<root>/.gdskv/index/`` (``<ns_id>.g<gid>.npy``: chunk index, inode,
parent chunk index), so a trailer is read once per chunk file, not once per scan.
"""
from __future__ import annotations

import io
import logging
import os
import secrets
import time
from typing import Optional, Sequence

import numpy as np

from gdskv import format as fmt
from gdskv.eviction import catalog
from gdskv.eviction.journal import INDEX_DIR, records
from gdskv.eviction.policy import NO_PARENT, ArrayRef, ChunkTable
from gdskv.keys import store_key
from gdskv.store import PRIVATE_DIR, Namespace, PageStore

log = logging.getLogger(__name__)

_CACHE_DTYPE = np.dtype([("index", "<u8"), ("ino", "<u8"), ("parent", "<u8")])


def chunk_index_of(ns_id: str, group: int, key: bytes) -> int:
    """The chunk index (``(hi << 50) | lo``) of block ``key`` in a namespace's layer group."""
    hi, lo = fmt.chunk_index(store_key(ns_id, group, key))
    return (hi << fmt.LO_BITS) | lo


def chunk_indexes(ns: Namespace, group: int, keys: Sequence[bytes]) -> np.ndarray:
    """``chunk_index_of`` of each key at once (``uint64``): the keys' store keys in one native
    run (``Namespace.store_key_run``), each index their leading bits. Called by ``Budget`` for
    the chunks a lookup touched and a step's saves published."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    leads = np.frombuffer(ns.store_key_run(group, keys), dtype=">u8")[::4].astype(np.uint64)
    return leads >> np.uint64(64 - fmt.HI_BITS - fmt.LO_BITS)


def chunk_records(kind: int, ns: Namespace, group: int, chunks: Sequence[tuple[bytes, Optional[bytes]]], nbytes: int,
                  mtime: Optional[np.ndarray] = None, at: Optional[int] = None) -> np.ndarray:
    """Journal records of ``kind`` for chunks ``(key, parent)`` of ``nbytes`` each in one array:
    their chunk indexes and their parents' (``NO_PARENT`` for none) from native runs. Called by
    ``Budget`` for a step's saves (their intents, then their publishes)."""
    parents = np.full(len(chunks), NO_PARENT, dtype=np.uint64)
    with_parent = [i for i, (_, parent) in enumerate(chunks) if parent is not None]
    parents[with_parent] = chunk_indexes(ns, group, [chunks[i][1] for i in with_parent])
    return records(kind, ns.id, group, chunk_indexes(ns, group, [key for key, _ in chunks]), parents, nbytes, mtime, at=at)


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


def _scan(store: PageStore, namespaces: Optional[Sequence[Namespace | str]], with_parents: bool,
          known_parents: Optional[dict[tuple[str, int], dict[int, int]]]) -> list[tuple[ArrayRef, tuple[np.ndarray, ...]]]:
    """Per array on disk: ``(ref, (index, parent index, size, mtime, atime))`` from one walk."""
    out = []
    for ref in _arrays(store, namespaces):
        idx_l, ino_l, size_l, mtime_l, atime_l = _walk_array(store, ref)
        idx = np.array(idx_l, dtype=np.uint64)
        ino = np.array(ino_l, dtype=np.uint64)
        if with_parents:
            parent_idx = _array_parents(store, ref, idx, ino, (known_parents or {}).get((ref.ns_id, ref.group), {}))
        else:
            parent_idx = np.full(idx.size, NO_PARENT, dtype=np.uint64)
        out.append((ref, (idx, parent_idx, np.array(size_l, dtype=np.int64), np.array(mtime_l, dtype=np.int64),
                          np.array(atime_l, dtype=np.int64))))
    return out


def scan_store(
    store: PageStore,
    namespaces: Optional[Sequence[Namespace | str]] = None,
    with_parents: bool = True,
    known_parents: Optional[dict[tuple[str, int], dict[int, int]]] = None,
) -> ChunkTable:
    """Every published chunk of ``namespaces`` (``Namespace`` objects or ids; default: every
    array on disk, damaged namespaces included) as a ``ChunkTable``, by a walk.

    One scandir per directory and one stat per chunk file (the store's walker). With
    ``with_parents`` the parent links are attached from the index cache (a trailer is read only
    for chunk files the cache has not seen); without, every ``parent`` is -1 (enough for sizes
    and listings). ``known_parents[(ns_id, group)][chunk index]`` supplies parents this process
    already knows. Called by ``gdskv evict`` / ``ls`` and ``rebuild_catalog``; ``Budget`` and
    ``gdskv info`` read the catalog instead.
    """
    scanned = _scan(store, namespaces, with_parents, known_parents)
    arrays = [ref for ref, _ in scanned]
    cols = [c for _, c in scanned]
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


def rebuild_catalog(store: PageStore) -> bool:
    """Walk the store and make the walk the chunk index (``gdskv.eviction.catalog``), unless
    another process is writing the index now; whether this one did. The journals' ends are taken
    before the walk: what is journaled from then on is applied on top of it; the publishing
    intents still unsettled then are carried into it (``catalog.in_flight``). Called by
    ``Budget`` on its background thread (no index yet, or an old one) and by ``gdskv info`` when
    a store has no index."""
    with catalog.writer_lock(store) as mine:
        if not mine:
            return False
        walked_at = time.time_ns()
        flying, ends = catalog.in_flight(store)
        arrays: list[tuple[str, int]] = []
        parts: list[dict[str, np.ndarray]] = []
        leases: dict[tuple[int, int], int] = {}
        for a, (ref, (idx, parent_idx, size, mtime, atime)) in enumerate(_scan(store, None, True, None)):
            order = np.argsort(idx)
            arrays.append((ref.ns_id, ref.group))
            parts.append({"array": np.full(idx.size, a, dtype=np.int32), "index": idx[order], "parent": parent_idx[order],
                          "nbytes": size[order], "mtime": mtime[order]})
            for i in np.nonzero(atime > walked_at)[0].tolist():
                leases[(a, int(idx[i]))] = int(atime[i])
        cols = {name: np.concatenate([p[name] for p in parts]).astype(t) if parts else np.zeros(0, dtype=t) for name, t in catalog.COLUMNS}
        catalog.write(store, catalog.Rows(arrays, cols, leases, flying), ends, walked_at)
        return True


def namespace_ids_matching(store: PageStore, wanted: str) -> list[str]:
    """Ids of the namespaces on disk (damaged ones included) whose id starts with ``wanted`` or
    whose model is ``wanted``. Called by ``gdskv evict`` / ``ls`` for ``--namespace``."""
    out = [ns.id for ns in store.namespaces() if ns.id.startswith(wanted) or ns.spec.model == wanted]
    return out + [ns_id for ns_id, _ in store.damaged_namespaces() if ns_id.startswith(wanted) and ns_id not in out]
