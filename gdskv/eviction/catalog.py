"""The chunk index: a snapshot of every chunk (its array, chunk index, parent, size, mtime) plus
the journals written since, so that sizes, listings and eviction choices cost a file read, not a
walk of the store. The chunk files stay the truth: the index is rebuilt from them by a walk
(``rebuild``) when it is missing, unreadable or old, and every removal checks the file itself
(``remove_chunk``), so a stale index can cost a wrong guess, never a leased or fresh chunk.

``<root>/.gdskv/index/catalog.json``  the commit point: the data file's name and row count,
                                      the arrays, per-array counts and bytes, the journal offsets
                                      the snapshot includes, leases still running, walk time,
                                      publishing intents still in flight
``<root>/.gdskv/index/catalog.<t>.bin``  the rows, column after column (``COLUMNS``), sorted by
                                      (array, chunk index)
``<root>/.gdskv/index/journal/``      per-process journals (``gdskv.eviction.journal``)

Readers settle the publishing intents of writers that died (``gdskv.eviction.intents``) as they
read the journals: a file looked at per chunk such a writer had on its way, never a walk.

Writers of the snapshot (``compact``, ``rebuild``) hold ``.gdskv/index/lock`` (``flock``, never
waited on: a process that finds it held leaves the work to its holder); readers take no lock.
Callers: ``Budget`` (totals at bring-up and every few seconds, the table when it must evict,
compaction and rebuilds on its background thread), ``gdskv info`` (``totals``).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from gdskv import format as fmt
from gdskv import jsondoc
from gdskv.eviction import intents
from gdskv.eviction.journal import INDEX_DIR, JOURNAL_DIR, PUBLISH, RECORD, REMOVE, TOUCH, read_each
from gdskv.eviction.policy import NO_PARENT, ArrayRef, ChunkTable
from gdskv.garbage import pid_alive
from gdskv.store import GROUP_DIR, NAMESPACE_ID, PRIVATE_DIR, PageStore

log = logging.getLogger(__name__)

BASE = f"{PRIVATE_DIR}/{INDEX_DIR}"
CATALOG = f"{BASE}/catalog.json"
COLUMNS = (("array", "<i4"), ("index", "<u8"), ("parent", "<u8"), ("nbytes", "<i8"), ("mtime", "<i8"))
_MAX_INDEX = np.uint64(1 << (fmt.HI_BITS + fmt.LO_BITS))


class CatalogMissing(OSError):
    """No usable index (none yet, or it does not match its data file): walk (``rebuild``)."""


@dataclass
class Rows:
    """The index in memory: ``cols`` by ``COLUMNS`` name, sorted by (array, index); ``arrays``
    are ``(ns_id, group)``; ``leases`` ``{(array, index): lease end ns}`` for running leases;
    ``intents`` the publishing intents still in flight (``gdskv.eviction.intents``)."""

    arrays: list[tuple[str, int]]
    cols: dict[str, np.ndarray]
    leases: dict[tuple[int, int], int] = field(default_factory=dict)
    intents: intents.Pending = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.cols["index"].size)

    @classmethod
    def empty(cls) -> "Rows":
        return cls([], {n: np.zeros(0, dtype=t) for n, t in COLUMNS})


@dataclass
class Header:
    """``catalog.json``: what a reader needs before (or instead of) the rows."""

    data: str
    rows: int
    arrays: list[tuple[str, int]]
    per_array: list[tuple[int, int]]
    journals: dict[str, int]
    leases: list[tuple[int, int, int]]
    walked_at_ns: int
    intents: intents.Pending

    @classmethod
    def read(cls, store: PageStore) -> "Header":
        try:
            d = jsondoc.loads(store.fs.read_small(CATALOG))
            h = cls(str(d["data"]), int(d["rows"]), [(str(a), int(g)) for a, g in d["arrays"]],
                    [(int(c), int(b)) for c, b in d["per_array"]], {str(k): int(v) for k, v in d["journals"].items()},
                    [(int(a), int(i), int(t)) for a, i, t in d["leases"]], int(d["walked_at_ns"]),
                    intents.from_json(d.get("intents")))
        except FileNotFoundError:
            raise CatalogMissing(f"no chunk index in {store.root}") from None
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CatalogMissing(f"chunk index of {store.root} is unreadable: {e}") from None
        ok = (h.data.startswith("catalog.") and "/" not in h.data and len(h.per_array) == len(h.arrays)
              and sum(c for c, _ in h.per_array) == h.rows
              and all(NAMESPACE_ID.match(a) and GROUP_DIR.match(f"g{g}") for a, g in h.arrays))
        if not ok:
            raise CatalogMissing(f"chunk index of {store.root} is inconsistent")
        return h


def _column_spans(n: int) -> list[tuple[str, np.dtype, int]]:
    out, off = [], 0
    for name, t in COLUMNS:
        dt = np.dtype(t)
        out.append((name, dt, off))
        off += -(-n * dt.itemsize // 8) * 8
    return out


def _open_data(store: PageStore, h: Header) -> int:
    """The snapshot's data file, open; ``CatalogMissing`` when it is gone or not the size its
    header says."""
    try:
        fd = store.fs.open_regular(f"{BASE}/{h.data}")
    except (OSError, ValueError) as e:
        raise CatalogMissing(f"chunk index data {h.data} is unreadable: {e}") from None
    spans = _column_spans(h.rows)
    if os.fstat(fd).st_size != spans[-1][2] + h.rows * 8:
        os.close(fd)
        raise CatalogMissing(f"chunk index data {h.data} has the wrong size")
    return fd


def _read_rows(store: PageStore, h: Header) -> dict[str, np.ndarray]:
    fd = _open_data(store, h)
    try:
        spans = _column_spans(h.rows)
        with open(fd, "rb", closefd=False) as f:
            cols = {name: np.fromfile(f, dtype=dt, count=h.rows, offset=off - f.tell()) if h.rows else np.zeros(0, dt)
                    for name, dt, off in spans}
    finally:
        os.close(fd)
    return cols


def read(store: PageStore) -> tuple[Rows, dict[str, int], int]:
    """The index with every journal record applied: ``(rows, journal offsets, walked_at_ns)``.
    ``CatalogMissing`` when there is none. Called by ``Budget`` before it evicts, ``compact``."""
    h = Header.read(store)
    cols = _read_rows(store, h)
    ok = (cols["array"] >= 0) & (cols["array"] < len(h.arrays)) & (cols["index"] < _MAX_INDEX)
    if not ok.all():  # a damaged row names nothing: drop it (a walk brings back what it hid)
        cols = {k: v[ok] for k, v in cols.items()}
    recs, flying, offsets, _ = _journaled(store, h)
    return apply(Rows(list(h.arrays), cols, {(a, i): t for a, i, t in h.leases}, flying), recs), offsets, h.walked_at_ns


def _journaled(store: PageStore, h: Header) -> tuple[np.ndarray, intents.Pending, dict[str, int], int]:
    """The records to apply on top of the snapshot ``h`` (the journals past its offsets, and what
    settling the due intents found: ``intents.settle``), the intents still in flight, the
    journals' new offsets and how many records were read. Called by ``read`` and ``totals``."""
    each, offsets = read_each(store, h.journals)
    recs, pending = intents.split(each, h.intents)
    settled, flying = intents.settle(store, intents.unsettled(pending, recs))
    return (np.concatenate([recs, settled]) if settled.size else recs), flying, offsets, sum(r.size for r in each.values())


def in_flight(store: PageStore) -> tuple[intents.Pending, dict[str, int]]:
    """The publishing intents not settled yet, and how far each journal was read for them: what a
    walk that starts now carries into its snapshot (a save may rename its chunk after the walk
    listed its directory, and die before it journals it). Called by ``rebuild_catalog`` before
    it walks."""
    try:
        h = Header.read(store)
        carried, offsets = h.intents, h.journals
    except CatalogMissing:
        carried, offsets = {}, {}
    each, ends = read_each(store, offsets)
    recs, pending = intents.split(each, carried)
    return intents.unsettled(pending, recs), ends


def _array_ids(rows: Rows, recs: np.ndarray) -> np.ndarray:
    """Each record's array id in ``rows.arrays`` (new arrays appended)."""
    have = {(int(ns, 16), g): i for i, (ns, g) in enumerate(rows.arrays)}
    pairs, inverse = np.unique(np.stack([recs["ns"], recs["group"].astype(np.uint64)], axis=1), axis=0, return_inverse=True)
    ids = []
    for ns, g in pairs.tolist():
        if (ns, g) not in have:
            have[(ns, g)] = len(rows.arrays)
            rows.arrays.append((f"{ns:016x}", int(g)))
        ids.append(have[(ns, g)])
    return np.asarray(ids, dtype=np.int32)[inverse.reshape(-1)]


def apply(rows: Rows, recs: np.ndarray) -> Rows:
    """``rows`` with ``recs`` applied: per chunk the last ``PUBLISH``/``REMOVE`` by ``at`` decides
    whether it is there; ``TOUCH`` records raise its mtime and lease. Pure (no I/O)."""
    recs = recs[(recs["index"] < _MAX_INDEX) & (recs["group"] < (1 << 31))]
    if recs.size == 0:
        return rows
    arr = _array_ids(rows, recs)
    cols = rows.cols
    order = np.lexsort((recs["at"], recs["index"], arr))
    recs, arr = recs[order], arr[order]
    last = np.ones(recs.size, dtype=bool)
    last[:-1] = (arr[1:] != arr[:-1]) | (recs["index"][1:] != recs["index"][:-1])
    exist = recs["kind"] != TOUCH
    # the last existence record per chunk: walk back from each chunk's last record
    starts = np.r_[True, last[:-1]]
    keyid = np.cumsum(starts) - 1
    final = np.full(keyid[-1] + 1, -1, dtype=np.int64)
    ex_pos = np.nonzero(exist)[0]
    final[keyid[ex_pos]] = ex_pos  # later positions overwrite earlier ones: the last wins
    touch_pos = np.nonzero(~exist)[0]
    t_mtime = np.full(final.size, np.iinfo(np.int64).min, dtype=np.int64)
    t_lease = np.zeros(final.size, dtype=np.int64)
    np.maximum.at(t_mtime, keyid[touch_pos], recs["mtime"][touch_pos])
    np.maximum.at(t_lease, keyid[touch_pos], recs["lease"][touch_pos])
    first = np.nonzero(starts)[0]
    k_arr, k_idx = arr[first], recs["index"][first]
    # where each chunk sits in ``rows`` (sorted by array, then index)
    pos = np.full(final.size, -1, dtype=np.int64)
    for a in np.unique(k_arr).tolist():
        lo, hi = np.searchsorted(cols["array"], [a, a + 1])
        sel = np.nonzero(k_arr == a)[0]
        p = lo + np.searchsorted(cols["index"][lo:hi], k_idx[sel])
        found = (p < hi) & (cols["index"][np.minimum(p, max(hi - 1, 0))] == k_idx[sel]) if hi > lo else np.zeros(sel.size, bool)
        pos[sel[found]] = p[found]
    kind = np.where(final >= 0, recs["kind"][np.maximum(final, 0)], 0)
    keep = np.ones(len(rows), dtype=bool)
    keep[pos[(kind == REMOVE) & (pos >= 0)]] = False
    upd = np.nonzero((kind == PUBLISH) & (pos >= 0))[0]
    for name in ("parent", "nbytes", "mtime"):
        cols[name][pos[upd]] = recs[name][final[upd]]
    new = np.nonzero((kind == PUBLISH) & (pos < 0))[0]
    touched = np.nonzero((final < 0) | (kind == PUBLISH))[0]
    tpos = pos[touched]
    at_old = touched[tpos >= 0]
    cols["mtime"][pos[at_old]] = np.maximum(cols["mtime"][pos[at_old]], t_mtime[at_old])
    out = {k: v[keep] for k, v in cols.items()}
    if new.size:
        add = {"array": k_arr[new], "index": k_idx[new], "parent": recs["parent"][final[new]],
               "nbytes": recs["nbytes"][final[new]], "mtime": np.maximum(recs["mtime"][final[new]], t_mtime[new])}
        out = {k: np.concatenate([out[k], add[k].astype(out[k].dtype)]) for k in out}
        order = np.lexsort((out["index"], out["array"]))
        out = {k: v[order] for k, v in out.items()}
    leases = dict(rows.leases)
    for k in np.nonzero(t_lease > 0)[0].tolist():
        key = (int(k_arr[k]), int(k_idx[k]))
        leases[key] = max(leases.get(key, 0), int(t_lease[k]))
    return Rows(rows.arrays, out, leases, rows.intents)


def _per_array(rows: Rows) -> list[tuple[int, int]]:
    n = len(rows.arrays)
    counts = np.bincount(rows.cols["array"], minlength=n)[:n]
    sizes = np.bincount(rows.cols["array"], weights=rows.cols["nbytes"], minlength=n)[:n]
    return [(int(c), int(b)) for c, b in zip(counts, sizes)]


@dataclass
class Summary:
    """What ``totals`` says: ``per_array`` ``{(ns_id, group): (chunks, bytes)}``, how many journal
    records the snapshot does not include yet, and when the store was last walked."""

    per_array: dict[tuple[str, int], tuple[int, int]]
    journal_records: int
    walked_at_ns: int
    journal_ends: dict[str, int] = field(default_factory=dict)
    """How far each journal was read: ``Budget`` adds a chunk published while it counted only
    where the count did not read its record."""

    @property
    def chunks(self) -> int:
        return sum(c for c, _ in self.per_array.values())

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.per_array.values())


def totals(store: PageStore) -> Summary:
    """Chunks and bytes per array now, from the header and the journals, reading only the rows
    the journals name (the snapshot's index column, by binary search): what ``gdskv info`` and
    ``Budget`` count, in milliseconds at any store size. ``CatalogMissing`` without an index."""
    h = Header.read(store)
    fd = _open_data(store, h)
    try:
        recs, _, ends, unfolded = _journaled(store, h)
        per = {a: c for a, c in zip(h.arrays, h.per_array)}
        if recs.size == 0:
            return Summary(per, unfolded, h.walked_at_ns, ends)
        # the rows the journal names, looked up in the snapshot, then the journal applied to just those
        spans = {name: (dt, off) for name, dt, off in _column_spans(h.rows)}
        with open(fd, "rb", closefd=False) as f:
            mm = {k: np.memmap(f, dtype=spans[k][0], mode="r", offset=spans[k][1], shape=(h.rows,)) if h.rows else np.zeros(0, spans[k][0])
                  for k in ("index", "nbytes")}
            starts = np.r_[0, np.cumsum([c for c, _ in h.per_array])].astype(np.int64)
            sub = Rows(list(h.arrays), {n: np.zeros(0, dtype=t) for n, t in COLUMNS})
            arr = _array_ids(sub, recs)
            picked: list[tuple[int, np.ndarray]] = []
            for a in np.unique(arr).tolist():
                want = np.unique(recs["index"][arr == a])
                if a < len(h.arrays) and starts[a + 1] > starts[a]:
                    col = mm["index"][starts[a]:starts[a + 1]]
                    p = np.searchsorted(col, want)
                    hit = p < col.size
                    hit[hit] = np.asarray(col[p[hit]]) == want[hit]
                    picked.append((a, starts[a] + p[hit]))
            rows_at = np.concatenate([p for _, p in picked]) if picked else np.zeros(0, np.int64)
            sub.cols = {"array": np.concatenate([np.full(p.size, a, np.int32) for a, p in picked]) if picked else np.zeros(0, np.int32),
                        "index": np.asarray(mm["index"][rows_at]), "parent": np.zeros(rows_at.size, np.uint64),
                        "nbytes": np.asarray(mm["nbytes"][rows_at]), "mtime": np.zeros(rows_at.size, np.int64)}
            before = _per_array(sub)
            after = _per_array(apply(Rows(sub.arrays, {k: v.copy() for k, v in sub.cols.items()}), recs))
            del mm
    finally:
        os.close(fd)
    for i, key in enumerate(sub.arrays):
        c0, b0 = per.get(key, (0, 0))
        (cb, bb) = before[i] if i < len(before) else (0, 0)
        (ca, ba) = after[i] if i < len(after) else (0, 0)
        per[key] = (c0 - cb + ca, b0 - bb + ba)
    return Summary(per, unfolded, h.walked_at_ns, ends)


def table(store: PageStore, rows: Rows, namespaces: Optional[dict] = None) -> ChunkTable:
    """The ``ChunkTable`` the policy ranks, from ``rows`` (parents resolved to rows within each
    array). ``namespaces``: ``{ns_id: Namespace}`` of sound namespaces (``PageStore.namespaces``),
    so that evictions are counted. Called by ``Budget`` before it evicts."""
    if namespaces is None:
        namespaces = {ns.id: ns for ns in store.namespaces()}
    cols = rows.cols
    refs = []
    for ns_id, g in rows.arrays:
        ns = namespaces.get(ns_id)
        owner = ns if ns is not None and any(x.layer_group_id == g for x in ns.spec.groups) else None
        refs.append(ArrayRef(ns_id, g, f"{store.root}/ns/{ns_id}/g{g}", owner))
    parent = np.full(len(rows), -1, dtype=np.int64)
    bounds = np.searchsorted(cols["array"], np.arange(len(rows.arrays) + 1))
    for a in range(len(rows.arrays)):
        lo, hi = int(bounds[a]), int(bounds[a + 1])
        if hi == lo:
            continue
        idx, par = cols["index"][lo:hi], cols["parent"][lo:hi]
        by_parent = np.argsort(par)  # sorted needles: the binary searches walk the column once
        p = np.empty(par.size, dtype=np.int64)
        p[by_parent] = np.minimum(np.searchsorted(idx, par[by_parent]), hi - lo - 1)
        found = (idx[p] == par) & (par != NO_PARENT)
        parent[lo:hi][found] = lo + p[found]
    leased = np.zeros(len(rows), dtype=np.int64)
    now = time.time_ns()
    for (a, i), t in rows.leases.items():
        if t > now and 0 <= a < len(rows.arrays):
            lo, hi = int(bounds[a]), int(bounds[a + 1])
            p = lo + int(np.searchsorted(cols["index"][lo:hi], np.uint64(i)))
            if p < hi and int(cols["index"][p]) == i:
                leased[p] = t
    return ChunkTable(refs, cols["array"], cols["index"], parent, cols["nbytes"], cols["mtime"], leased)


@contextmanager
def writer_lock(store: PageStore) -> Iterator[bool]:
    """``.gdskv/index/lock`` taken without waiting: yields whether this process holds it."""
    store.fs.makedirs(BASE)
    fd = store.fs.open(f"{BASE}/lock", os.O_CREAT | os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write(store: PageStore, rows: Rows, offsets: dict[str, int], walked_at_ns: int) -> None:
    """Commit ``rows`` as the snapshot (data file made durable, then ``catalog.json`` renamed over
    the old one), drop the old data file and the journals of dead writers it fully includes.
    Caller holds ``writer_lock``."""
    name = f"catalog.{time.time_ns()}.{secrets.token_hex(3)}.bin"
    tmp = f"{BASE}/{name}{fmt.TMP_MARK}{os.getpid()}"
    fd = store.fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        for col, (_, dt, off) in zip(COLUMNS, _column_spans(len(rows))):
            data = memoryview(np.ascontiguousarray(rows.cols[col[0]], dtype=dt)).cast("B")
            pad = -len(data) % 8
            for piece in (data, memoryview(bytes(pad))):
                while piece:
                    piece = piece[os.write(fd, piece):]
        os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        store.fs.unlink(tmp)
        raise
    os.close(fd)
    store.fs.rename(tmp, f"{BASE}/{name}")
    now = time.time_ns()
    doc = {"data": name, "rows": len(rows), "arrays": [list(a) for a in rows.arrays], "per_array": [list(x) for x in _per_array(rows)],
           "journals": offsets, "leases": [[a, i, t] for (a, i), t in rows.leases.items() if t > now], "walked_at_ns": walked_at_ns,
           "intents": intents.to_json(rows.intents)}
    store.fs.write_atomic(CATALOG, json.dumps(doc).encode(), f"{fmt.TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    _drop_unused(store, name, offsets)


def _drop_unused(store: PageStore, keep: str, offsets: dict[str, int]) -> None:
    for e in store.fs.scandir(BASE, with_stat=True):
        if e.kind == "file" and e.name.startswith("catalog.") and e.name.endswith(".bin") and e.name != keep:
            _unlink(store, f"{BASE}/{e.name}")
    host = socket.gethostname()
    for e in store.fs.scandir(JOURNAL_DIR, with_stat=True):
        parts = e.name.rsplit("-", 3)
        if (e.kind == "file" and e.st is not None and len(parts) == 4 and parts[0] == host and parts[1].isdigit()
                and offsets.get(e.name, -1) == e.st.st_size - e.st.st_size % RECORD.itemsize and not pid_alive(int(parts[1]))):
            _unlink(store, f"{JOURNAL_DIR}/{e.name}")


def _unlink(store: PageStore, rel: str) -> None:
    try:
        store.fs.unlink(rel)
    except OSError:
        pass


def compact(store: PageStore) -> bool:
    """Fold the journals into a new snapshot, if no other process is at it; whether this one
    did. Called by ``Budget`` on its background thread when the journals have grown."""
    with writer_lock(store) as mine:
        if not mine:
            return False
        rows, offsets, walked = read(store)
        write(store, rows, offsets, walked)
        return True
