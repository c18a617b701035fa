"""The chunk index (issue 13, "cost that does not grow with the store"): bring-up, saves and
``gdskv info`` never walk the store; the index (snapshot + per-process journals) stays equal to the
files across processes, survives kill -9 and damage by being rebuilt from the files, and a stale
index never costs a leased or freshly used chunk."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv import eviction as ev
from gdskv.cli.main import main as cli_main
from gdskv.config import GdsKvConfig
from gdskv.eviction import catalog, install_budget, scan_store
from gdskv.eviction.journal import JOURNAL_DIR, PUBLISH, RECORD, REMOVE, TOUCH, records
from gdskv.eviction.policy import NO_PARENT
from gdskv.io import batch as batchio
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer, SaveStatus

PAGE = 64
CHUNK = PAGE + 128
TPB = 2
SPEC = NamespaceSpec("test/index", "uint8", TPB, (GroupSpec(0, PAGE, (0,)), GroupSpec(1, PAGE, (1,))))


def _walk(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    """Chunks and bytes per array, by a walk of the files (the truth)."""
    t = scan_store(store, with_parents=False)
    out = {}
    for i, ref in enumerate(t.arrays):
        sel = t.array == i
        if sel.any():
            out[(ref.ns_id, ref.group)] = (int(sel.sum()), int(t.nbytes[sel].sum()))
    return out


def _indexed(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    return {k: v for k, v in catalog.totals(store).per_array.items() if v[0]}


def _save(xfer: PageTransfer, tokens: list[int], group: int = 0) -> list[SaveStatus]:
    keys = chain_keys(tokens, TPB)
    return [xfer.save_page(group, k, keys[i - 1] if i else None, [torch.full((PAGE,), i % 251, dtype=torch.uint8)]).result()
            for i, k in enumerate(keys)]


class _Server:
    """One process's view: store, budget, transfers (as a connector's bring-up makes them)."""

    def __init__(self, root: Path, max_chunks: int) -> None:
        self.store = PageStore.open(root)
        self.ns = self.store.namespace(SPEC)
        self.budget = install_budget(self.store, GdsKvConfig(store_path=str(root), max_bytes=max_chunks * CHUNK))
        self.engine = PosixEngine(threads=2)
        self.xfer = PageTransfer(self.ns, self.engine, threads=2)

    def close(self) -> None:
        self.xfer.close()
        self.engine.close()


# --- pure: the journal applied to a snapshot --------------------------------------------------
_op = st.tuples(st.sampled_from([PUBLISH, TOUCH, REMOVE]), st.integers(0, 5), st.integers(0, 1), st.integers(0, 50))


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40), st.lists(st.integers(0, 5), unique=True, max_size=4))
def test_apply_matches_a_model(ops: list[tuple[int, int, int, int]], base: list[int]) -> None:
    """Per chunk, the last publish/remove by ``at`` decides presence; touches only raise mtime."""
    ns = "00000000000000ab"
    model = {(0, i): (10, 100) for i in base}  # (array, index) -> (nbytes, mtime)
    rows = catalog.Rows([(ns, 0)], {"array": np.zeros(len(base), np.int32), "index": np.array(sorted(base), np.uint64),
                                    "parent": np.full(len(base), ev.NO_PARENT, np.uint64), "nbytes": np.full(len(base), 10, np.int64),
                                    "mtime": np.full(len(base), 100, np.int64)})
    recs = np.concatenate([records(k, ns, g, np.uint64(i), nbytes=20 + at, mtime=1000 + at, at=at) for k, i, g, at in ops]) if ops else np.zeros(0, dtype=RECORD)
    last: dict[tuple[int, int], tuple[int, int, int]] = {}
    touch: dict[tuple[int, int], int] = {}
    for seq, (k, i, g, at) in sorted(enumerate(ops), key=lambda e: (e[1][3], e[0])):
        key = (g, i)
        if k == TOUCH:
            touch[key] = max(touch.get(key, 0), 1000 + at)
        else:
            last[key] = (k, 20 + at, 1000 + at)
    for key, (k, nbytes, mtime) in last.items():
        if k == REMOVE:
            model.pop(key, None)
        else:
            model[key] = (nbytes, mtime)
    model = {key: (nb, max(mt, touch.get(key, 0))) for key, (nb, mt) in model.items()}
    out = catalog.apply(rows, recs)
    got = {}
    for a, i, nb, mt in zip(out.cols["array"].tolist(), out.cols["index"].tolist(), out.cols["nbytes"].tolist(), out.cols["mtime"].tolist()):
        got[(out.arrays[a][1], i)] = (nb, mt)
    assert got == model
    assert np.all(np.diff(out.cols["array"]) >= 0)


def test_chunk_indexes_of_a_run_are_each_keys_chunk_index(tmp_path: Path) -> None:
    ns = PageStore.open(tmp_path / "store").namespace(NamespaceSpec("idx/m", "uint8", 2, (GroupSpec(3, 64, (0,)),)))
    keys = [os.urandom(32) for _ in range(300)] + [os.urandom(8) for _ in range(5)]
    got = ev.index.chunk_indexes(ns, 3, keys)
    assert got.dtype == np.uint64
    assert got.tolist() == [ev.index.chunk_index_of(ns.id, 3, k) for k in keys]
    assert ev.index.chunk_indexes(ns, 3, []).tolist() == []


def test_a_steps_published_saves_are_journaled_as_their_files_are(tmp_path: Path) -> None:
    """One record batch for a step's saves: each chunk's index, its parent's, its size and its
    file's mtime; a chunk removed before the step is reaped is not journaled."""
    s = _Server(tmp_path / "store", 1000)
    try:
        keys = chain_keys(list(range(12)), TPB)
        pages = [torch.full((PAGE,), i, dtype=torch.uint8) for i in range(len(keys))]
        futures = s.xfer.save_pages(0, [(k, keys[i - 1] if i else None, [pages[i]]) for i, k in enumerate(keys)])
        assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 6
        recs, _ = ev.journal.read_journals(s.store, {})
        recs = recs[recs["kind"] == PUBLISH]
        assert recs["index"].tolist() == [ev.index.chunk_index_of(s.ns.id, 0, k) for k in keys]
        assert recs["parent"].tolist() == [int(NO_PARENT)] + [ev.index.chunk_index_of(s.ns.id, 0, k) for k in keys[:-1]]
        assert set(recs["nbytes"].tolist()) == {CHUNK}
        assert recs["mtime"].tolist() == [os.lstat(s.ns.chunk_path(0, k)).st_mtime_ns for k in keys]
        before = len(recs)
        more = chain_keys(list(range(100, 104)), TPB)
        s.budget.on_published_many(s.ns, 0, [(more[0], None)], CHUNK)  # never written: nothing to journal
        recs, _ = ev.journal.read_journals(s.store, {})
        assert int((recs["kind"] == PUBLISH).sum()) == before
    finally:
        s.close()


def test_chunk_mtimes_are_the_files_with_and_without_the_native_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _Server(tmp_path / "store", 1000)
    try:
        keys = chain_keys(list(range(6)), TPB)
        assert _save(s.xfer, list(range(6))) == [SaveStatus.PUBLISHED] * 3
        cut = Path(s.ns.chunk_path(0, keys[1]))
        cut.write_bytes(cut.read_bytes()[:-1])
        asked = keys + chain_keys([900, 901], TPB)  # the last one never saved
        want = [os.lstat(s.ns.chunk_path(0, keys[0])).st_mtime_ns, None, os.lstat(s.ns.chunk_path(0, keys[2])).st_mtime_ns,
                None]
        assert s.ns.chunk_mtimes(0, asked, CHUNK) == want
        monkeypatch.setattr(batchio, "_working", False)
        assert s.ns.chunk_mtimes(0, asked, CHUNK) == want
    finally:
        s.close()


# --- no walk on the serving path ----------------------------------------------------------------
def test_bring_up_saves_and_info_read_the_index_not_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    s = _Server(root, 1000)
    _save(s.xfer, list(range(12)))
    s.close()
    truth = _walk(PageStore.open(root))
    monkeypatch.setattr(ev.index, "_walk_array", lambda *a: pytest.fail("walked the store"))
    again = _Server(root, 1000)  # a restart
    try:
        assert again.budget.counted.is_set() and again.budget.used_bytes == 6 * CHUNK
        assert _save(again.xfer, list(range(100, 104))) == [SaveStatus.PUBLISHED] * 2
    finally:
        again.close()
    res = CliRunner().invoke(cli_main, ["--store", str(root), "info", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chunks"] == sum(n for n, _ in truth.values()) + 2


def test_without_an_index_saves_go_on_while_the_store_is_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store with no index (made by an older gdskv): it is walked on a background thread; bring-up
    and saves do not wait for the walk (they go by the file system's used bytes meanwhile)."""
    root = tmp_path / "store"
    s = _Server(root, 10**9)
    _save(s.xfer, list(range(8)))
    s.close()
    for p in (root / ".gdskv" / "index").iterdir():
        if p.is_file():
            p.unlink()
    walking, release = threading.Event(), threading.Event()
    real = ev.index._walk_array

    def slow_walk(*a: Any) -> Any:
        walking.set()
        release.wait(30)
        return real(*a)

    monkeypatch.setattr(ev.index, "_walk_array", slow_walk)
    big = _Server(root, 10**15 // CHUNK)  # far above the file system's used bytes: saves fit even before the count
    try:
        assert walking.wait(10) and not release.is_set()
        assert big.budget.used_bytes is None
        assert _save(big.xfer, list(range(200, 204))) == [SaveStatus.PUBLISHED] * 2  # while the walk is held
        release.set()
        assert big.budget.counted.wait(10)
        assert _indexed(big.store) == _walk(big.store)
    finally:
        release.set()
        big.close()


# --- a stale index never costs a leased or freshly used chunk ----------------------------------
def test_a_stale_index_keeps_chunks_used_since_and_learns_their_use(tmp_path: Path) -> None:
    root = tmp_path / "store"
    s = _Server(root, 1000)
    try:
        _save(s.xfer, list(range(0, 8)))
        _save(s.xfer, list(range(100, 108)))
        catalog.compact(s.store)
        # another process without a budget uses chunks: nothing reaches the journals
        other = PageStore.open(root).namespace(SPEC)
        used, leased = chain_keys(list(range(0, 8)), TPB), chain_keys(list(range(100, 108)), TPB)
        os.utime(other.chunk_path(0, used[3]))  # a load refreshed its mtime
        assert all(other.lease_many(0, leased[:2], lease_seconds=60))
        s.budget.headroom = 0.0
        with s.budget._evicting:  # two chunks: the index ranks used[3] first, and it is kept
            done = s.budget.evict(2 * CHUNK)
        assert done.skipped_fresh == 1 and done.skipped_leased == 0 and done.freed_bytes == 2 * CHUNK
        assert s.ns.contains_many(0, used) == [True] * 4
        assert s.ns.contains_many(0, leased) == [True, True, False, False]
        assert _indexed(s.store) == _walk(s.store)
        rows, _, _ = catalog.read(s.store)
        t = catalog.table(s.store, rows)
        row = int(t.rows_of([s.ns.chunk_path(0, used[3])])[0])
        assert int(t.mtime_ns[row]) == os.stat(s.ns.chunk_path(0, used[3])).st_mtime_ns  # learnt at removal
        with s.budget._evicting:  # all it can: the leased ones stay, the used chain goes once its use is known
            done = s.budget.evict(10**9)
        assert done.skipped_leased >= 1 and done.removed == 4
        assert s.ns.contains_many(0, used) == [False] * 4
        assert s.ns.contains_many(0, leased) == [True, True, False, False]
    finally:
        s.close()


# --- several processes, kill -9, damage -------------------------------------------------------
def _worker(root: str, wid: int, chains: int, ready: Any) -> None:
    s = _Server(Path(root), 24)
    i = 0
    while chains < 0 or i < chains:
        _save(s.xfer, [wid * 100_000 + i * 100 + t for t in range(8)], group=i % 2)
        ready.set()  # once its journal holds a record: the kill then always has one to cut into
        if i:
            s.ns.lease_many(i % 2, chain_keys([wid * 100_000 + (i - 1) * 100 + t for t in range(8)], TPB), 0.0)
        i += 1
    s.close()


@pytest.mark.slow
def test_the_index_follows_several_processes_and_heals_after_kill_9(tmp_path: Path) -> None:
    root = tmp_path / "store"
    PageStore.open(root).namespace(SPEC)
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(3)]
    procs = [ctx.Process(target=_worker, args=(str(root), w, 20, ready[w])) for w in range(2)]
    procs.append(ctx.Process(target=_worker, args=(str(root), 2, -1, ready[2])))  # runs until killed
    for p in procs:
        p.start()
    for p in procs[:2]:
        p.join(120)
        assert p.exitcode == 0
    assert ready[2].wait(60)
    time.sleep(0.3)
    os.kill(procs[2].pid, signal.SIGKILL)
    procs[2].join(30)
    store = PageStore.open(root)
    # the exited workers' journals may already be folded into the catalog and dropped; the killed
    # one's never is, since its process was alive at every compaction
    killed = [j for j in (root / JOURNAL_DIR).iterdir() if j.name.rsplit("-", 3)[1] == str(procs[2].pid)]
    assert killed
    with open(killed[-1], "ab") as f:
        f.write(b"\x01torn")  # a record cut short by a crash: never read as one
    truth, seen = _walk(store), _indexed(store)
    # evictions ran in every process and are all in the index; only the killed process's last
    # operation may be missing from it
    assert store.private.joinpath("stats").exists()
    for key in truth.keys() | seen.keys():
        assert abs(truth.get(key, (0, 0))[0] - seen.get(key, (0, 0))[0]) <= 1, (key, truth, seen)
    assert ev.rebuild_catalog(store)
    assert _indexed(store) == _walk(store)


def test_a_damaged_index_is_rebuilt_from_the_files_and_never_reaches_outside(tmp_path: Path) -> None:
    root = tmp_path / "store"
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_bytes(b"precious")
    s = _Server(root, 1000)
    _save(s.xfer, list(range(10)))
    s.close()
    doc = json.loads((root / catalog.CATALOG).read_text())
    doc["arrays"][0][0] = "../../canary"
    (root / catalog.CATALOG).write_text(json.dumps(doc))
    with pytest.raises(catalog.CatalogMissing):
        catalog.totals(PageStore.open(root))
    (root / catalog.CATALOG).write_text("{not json")
    again = _Server(root, 3)  # unreadable index: walked again at bring-up (in the background)
    try:
        assert again.budget.counted.wait(10)
        assert _indexed(again.store) == _walk(again.store)
        data = root / ".gdskv" / "index" / json.loads((root / catalog.CATALOG).read_text())["data"]
        with open(data, "r+b") as f:
            f.truncate(7)  # a data file that does not match its header
        with pytest.raises(catalog.CatalogMissing):
            catalog.read(again.store)
        again.budget.refresh()
        assert _save(again.xfer, list(range(300, 306)))
        assert sum(n for n, _ in _walk(again.store).values()) <= 3
        assert _indexed(again.store) == _walk(again.store)
    finally:
        again.close()
    assert [p.name for p in canary.iterdir()] == ["keep"] and (canary / "keep").read_bytes() == b"precious"


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(0, 10**6), st.integers(1, 8), st.integers(1, 40))
def test_choosing_by_partition_is_a_prefix_of_the_full_order(n: int, seed: int, distinct: int, want_chunks: int) -> None:
    """``select_victims`` sorts only the rows up to a threshold; what it picks is exactly the
    shortest prefix of ``eviction_order`` holding the bytes (ties in recency included)."""
    rng = np.random.default_rng(seed)
    parent = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n)], dtype=np.int64)
    mtime = rng.integers(0, distinct, n).astype(np.int64)
    nbytes = rng.integers(1, 4, n).astype(np.int64)
    table = ev.ChunkTable([], np.zeros(n, np.int32), np.arange(n, dtype=np.uint64), parent, nbytes, mtime)
    need = want_chunks * 2
    got = ev.select_victims(table, need)
    order, _ = ev.eviction_order(parent, mtime)
    cum = np.cumsum(nbytes[order])
    assert got.tolist() == order[: int(np.searchsorted(cum, need, side="left")) + 1].tolist()
