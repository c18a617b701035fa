"""Eviction: the pure policy, the index, and the budget hook on a real store through PageTransfer."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from click.testing import CliRunner
from hypothesis import strategies as st

from gdskv import eviction as ev
from gdskv.cli.main import main as cli_main
from gdskv.config import GdsKvConfig
from gdskv.eviction import Budget, ChunkInfo, Limits, catalog, install_budget, pick_victims, scan_store, select_victims, shortfall
from gdskv.eviction.budget import UNLIMITED_REFRESH_S
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer, SaveStatus

PAGE = 64
CHUNK = PAGE + 128
TPB = 2


def _c(idx: int, parent: int | None, mtime: int, nbytes: int = 10, group: int = 0, ns: str = "n") -> ChunkInfo:
    return ChunkInfo(ns, group, idx, parent, nbytes, mtime, path=f"{ns}/{group}/{idx}")


def _paths(chunks: list[ChunkInfo]) -> list[str]:
    return [c.path.rsplit("/", 1)[1] for c in chunks]


# --- pure policy -----------------------------------------------------------------------------------
def test_chain_goes_deepest_first_and_leaves_by_recency() -> None:
    chunks = [_c(1, None, 100), _c(2, 1, 50), _c(3, 2, 300), _c(4, None, 200)]
    assert _paths(pick_victims(chunks, None)) == ["4", "3", "2", "1"]
    assert _paths(pick_victims(chunks, 15)) == ["4", "3"]
    assert pick_victims(chunks, 0) == []


def test_shared_root_outlives_every_branch() -> None:
    # root 1 with branches 2 (old) and 3 -> 4 (new)
    chunks = [_c(1, None, 10), _c(2, 1, 20), _c(3, 1, 30), _c(4, 3, 500)]
    order = _paths(pick_victims(chunks, None))
    assert order == ["2", "4", "3", "1"]


def test_ties_go_deeper_first() -> None:
    chunks = [_c(1, None, 7), _c(2, None, 7), _c(3, 2, 7), _c(4, 3, 7)]
    assert _paths(pick_victims(chunks, None)) == ["4", "3", "1", "2"]


def test_pinned_chunk_keeps_its_ancestors() -> None:
    chunks = [_c(1, None, 1), _c(2, 1, 2), _c(3, 2, 3), _c(9, None, 100)]
    out = _paths(pick_victims(chunks, None, pinned={"n/0/3"}))
    assert out == ["9"]
    out = _paths(pick_victims(chunks, None, pinned={"n/0/2"}))
    assert out == ["3", "9"]


def test_older_than_keeps_an_old_block_with_a_young_descendant() -> None:
    chunks = [_c(1, None, 10), _c(2, 1, 1000), _c(3, None, 20), _c(4, 3, 30)]
    assert _paths(pick_victims(chunks, None, older_than_ns=500)) == ["4", "3"]


def test_parents_are_per_namespace_and_group() -> None:
    # chunk index 1 exists in group 0 and group 1; only group 0's child names it
    chunks = [_c(1, None, 10), _c(2, 1, 20), _c(1, None, 5, group=1), _c(1, None, 6, ns="m")]
    out = pick_victims(chunks, None)
    assert [(c.ns_id, c.group, c.index) for c in out] == [("n", 1, 1), ("m", 0, 1), ("n", 0, 2), ("n", 0, 1)]


def test_cycles_from_corrupt_trailers_terminate() -> None:
    chunks = [_c(1, 2, 10), _c(2, 1, 20), _c(3, 3, 5), _c(4, None, 1)]
    assert sorted(_paths(pick_victims(chunks, None))) == ["1", "2", "3", "4"]


def test_depths_of_a_long_chain() -> None:
    n = 5000
    parent = np.arange(-1, n - 1, dtype=np.int64)
    assert ev.depths(parent).tolist() == list(range(n))


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9), st.booleans()), min_size=1, max_size=30),
       want=st.integers(1, 400))
def test_a_table_less_removed_rows_ranks_as_a_table_of_what_is_left(shape: list[tuple[int, int, bool]], want: int) -> None:
    """``ChunkTable.without`` (a later ranking of ``Budget.evict``) renumbers parents: it ranks
    what is left exactly as a table built from the remaining chunks, where a chunk whose parent
    went is a root."""
    chunks = [_c(i, None if up % (i + 1) == i or not i else up % i, mtime, nbytes=10 + i)
              for i, (up, mtime, _) in enumerate(shape)]
    gone = [i for i, (_, _, drop) in enumerate(shape) if drop]
    left = [c for i, c in enumerate(chunks) if i not in gone]
    less = ev.ChunkTable.from_chunks(chunks).without(gone)
    fresh = ev.ChunkTable.from_chunks(left)
    assert less.parent.tolist() == fresh.parent.tolist()
    assert less.index.tolist() == fresh.index.tolist()
    assert select_victims(less, want).tolist() == select_victims(fresh, want).tolist()
    assert select_victims(less, None).tolist() == select_victims(fresh, None).tolist()


def test_shortfall() -> None:
    assert shortfall(Limits(max_bytes=100), used=90, fs_total=1000, fs_free=500, incoming=10) == 0
    assert shortfall(Limits(max_bytes=100), used=95, fs_total=1000, fs_free=500, incoming=10) == 5
    assert shortfall(Limits(min_free_bytes=300), used=0, fs_total=1000, fs_free=305, incoming=10) == 5
    assert shortfall(Limits(min_free_percent=50.0), used=0, fs_total=1000, fs_free=500, incoming=10) == 10
    assert shortfall(Limits(), used=10**9, fs_total=1, fs_free=0, incoming=10) == 0


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple]:
    return draw(st.lists(st.one_of(
        st.tuples(st.just("new"), st.integers(0, 50), st.integers(0, 6), st.integers(1, 8)),
        st.tuples(st.just("save"), st.integers(0, 50)),
        st.tuples(st.just("touch"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(0, 40)),
    ), min_size=1, max_size=40))


class _Model:
    """A store of chains in memory: blocks keyed by their chained key, parents known."""

    def __init__(self) -> None:
        self.chains: list[list[bytes]] = []
        self.parent: dict[bytes, bytes | None] = {}
        self.stored: dict[bytes, int] = {}  # key -> mtime
        self.clock = 0

    def new_chain(self, src: int, fork: int, extra: int, rng_seed: int) -> None:
        base = self.chains[src % len(self.chains)][:fork] if self.chains and fork else []
        keys = list(base)
        parent = keys[-1] if keys else None
        for i in range(extra):
            k = (rng_seed * 1000 + len(self.chains) * 100 + i).to_bytes(8, "big")
            self.parent[k] = parent
            keys.append(k)
            parent = k
        self.chains.append(keys)

    def first_missing(self, chain: list[bytes]) -> int:
        for i, k in enumerate(chain):
            if k not in self.stored:
                return i
        return len(chain)

    def table(self) -> list[ChunkInfo]:
        idx = {k: int.from_bytes(k, "big") for k in self.stored}
        return [ChunkInfo("n", 0, idx[k], None if self.parent[k] is None else int.from_bytes(self.parent[k], "big"), CHUNK, t, path=k.hex())
                for k, t in self.stored.items()]


def _no_orphans(parent_of: dict[bytes, bytes | None], stored: set[bytes]) -> None:
    for k in stored:
        p = parent_of[k]
        assert p is None or p in stored, "a stored block lost its stored ancestor to eviction"


@settings(max_examples=200, deadline=None)
@given(ops=_ops(), budget_chunks=st.integers(2, 12))
def test_property_prefix_aware_and_within_budget_pure(ops: list[tuple], budget_chunks: int) -> None:
    """Saves in prefix order (each admitted by ``shortfall`` + ``pick_victims`` protecting its
    parent chain), touches, and explicit evictions: no block is ever removed while a descendant
    stays, and the store never exceeds its budget."""
    m = _Model()
    limits = Limits(max_bytes=budget_chunks * CHUNK)
    for n, op in enumerate(ops):
        m.clock += 1
        if op[0] == "new" or not m.chains:
            m.new_chain(op[1] if op[0] == "new" else 0, op[2] if op[0] == "new" else 0, op[3] if op[0] == "new" else 3, n)
            continue
        chain = m.chains[op[1] % len(m.chains)]
        if op[0] == "save":
            i = m.first_missing(chain)
            if i == len(chain):
                continue
            need = shortfall(limits, len(m.stored) * CHUNK, 10**12, 10**12, CHUNK)
            if need:
                protect = {chain[i - 1].hex()} if i else set()
                for v in pick_victims(m.table(), need, pinned=protect):
                    del m.stored[bytes.fromhex(v.path)]
            if shortfall(limits, len(m.stored) * CHUNK, 10**12, 10**12, CHUNK) == 0:
                m.stored[chain[i]] = m.clock
        elif op[0] == "touch":
            for k in chain[: m.first_missing(chain)]:
                m.stored[k] = m.clock
        else:
            for v in pick_victims(m.table(), op[1] * CHUNK):
                del m.stored[bytes.fromhex(v.path)]
        _no_orphans(m.parent, set(m.stored))
        assert len(m.stored) * CHUNK <= limits.max_bytes


# --- real store ----------------------------------------------------------------------------------
def _spec(groups: int = 1) -> NamespaceSpec:
    return NamespaceSpec("test/evict", "uint8", TPB, tuple(GroupSpec(g, PAGE, (g,)) for g in range(groups)))


class _Rig:
    def __init__(self, root: Path, groups: int = 1) -> None:
        self.store = PageStore.open(root)
        self.ns = self.store.namespace(_spec(groups))
        self.engine = PosixEngine(threads=2)
        self.xfer = PageTransfer(self.ns, self.engine, threads=2)

    def save_chain(self, tokens: list[int], group: int = 0) -> list[SaveStatus]:
        keys = chain_keys(tokens, TPB)
        out = []
        for i, k in enumerate(keys):
            page = torch.full((PAGE,), i % 251, dtype=torch.uint8)
            out.append(self.xfer.save_page(group, k, keys[i - 1] if i else None, [page]).result())
        return out

    def stored_bytes(self) -> int:
        return sum(e.stat().st_size for _, _, e in self.store.iter_chunk_files())

    def close(self) -> None:
        self.xfer.close()
        self.engine.close()


@pytest.fixture
def rig(tmp_path: Path):
    r = _Rig(tmp_path / "store")
    yield r
    r.close()


def test_scan_attaches_parents_and_caches_them(rig: _Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.save_chain(list(range(8)))  # 4 blocks
    table = scan_store(rig.store)
    assert len(table) == 4 and table.total_bytes == 4 * CHUNK
    assert sorted(ev.depths(table.parent).tolist()) == [0, 1, 2, 3]
    assert list((rig.store.private / ev.INDEX_DIR).glob("*.npy"))
    monkeypatch.setattr(ev.index, "_read_parent", lambda *a: pytest.fail("trailer read although the index has it"))
    again = scan_store(PageStore.open(rig.store.root))
    assert sorted(ev.depths(again.parent).tolist()) == [0, 1, 2, 3]


def test_budget_keeps_store_under_max_bytes(rig: _Rig) -> None:
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=10 * CHUNK))
    assert budget is not None and rig.store.budget is budget
    for p in range(8):
        rig.save_chain([1000 * p + t for t in range(8)])
        assert rig.stored_bytes() <= 10 * CHUNK
    assert rig.ns.counters["evicted"] > 0
    assert rig.ns.counters["evicted_bytes"] == rig.ns.counters["evicted"] * CHUNK
    for p in range(8):  # what is left of each chain is a prefix of it
        present = rig.ns.contains_many(0, chain_keys([1000 * p + t for t in range(8)], TPB))
        assert present == sorted(present, reverse=True)


def test_saves_posted_from_the_serving_thread_never_evict_there(rig: _Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full budget makes room on a transfer thread: the thread that posts a step's saves (the
    serving loop) never runs an eviction, and every save still lands within the budget."""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=6 * CHUNK))
    budget.headroom = 0.0
    evicted_on: list[int] = []
    evict = budget.evict

    def recorded(need: int, protect=()):
        evicted_on.append(threading.get_ident())
        return evict(need, protect)

    monkeypatch.setattr(budget, "evict", recorded)
    for step in range(6):
        keys = chain_keys([1000 * step + t for t in range(8)], 1)[:4]
        futures = rig.xfer.save_pages(0, [(k, None, [torch.full((PAGE,), step, dtype=torch.uint8)]) for k in keys])
        assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 4
        assert rig.stored_bytes() <= 6 * CHUNK
    assert evicted_on and threading.get_ident() not in evicted_on
    assert rig.ns.counters["evicted"] >= 18


class _Ready:
    """A ``ready`` event already reached: sends a step's saves down the transfer pool's path."""

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("ready", [None, _Ready()], ids=["posted-from-the-step", "transfer-pool"])
def test_a_chain_saved_in_one_step_on_a_full_store_evicts_for_every_block(rig: _Rig, ready) -> None:
    """A block whose parent is still being written in the same step is not refused as an orphan:
    the budget makes room for the whole chain, keeping the blocks above it. (It used to save the
    blocks that fit and drop the rest.)"""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=56 * CHUNK))
    assert budget.counted.wait(10)
    budget.headroom = 0.0
    old = [list(range(100 * c, 100 * c + 16)) for c in range(4)]
    for tokens in old:
        assert rig.save_chain(tokens) == [SaveStatus.PUBLISHED] * 8
    keys = chain_keys(list(range(9000, 9080)), TPB)  # 40 blocks; room for 24
    items = [(k, keys[i - 1] if i else None, [torch.full((PAGE,), i, dtype=torch.uint8)]) for i, k in enumerate(keys)]
    assert [f.result() for f in rig.xfer.save_pages(0, items, ready)] == [SaveStatus.PUBLISHED] * 40
    assert all(rig.ns.contains_many(0, keys))
    assert rig.stored_bytes() <= 56 * CHUNK
    assert rig.ns.counters["saves_dropped_budget"] == 0
    for tokens in old:  # what is left of an older chain is a prefix of it
        present = rig.ns.contains_many(0, chain_keys(tokens, TPB))
        assert present == sorted(present, reverse=True)
    assert len(rig.xfer._saving) == 0, "finished saves are forgotten"


def test_a_block_refused_by_the_budget_is_not_counted_on_its_way_for_its_child(rig: _Rig) -> None:
    """The first block of a chain posted in one step is refused (its eviction waited past
    ``max_wait_seconds`` for another thread's); its child, next in the slice, must not evict for
    itself as if the parent would land: it would be stored as an orphan, never served, in place
    of servable chunks."""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=16 * CHUNK))
    assert budget.counted.wait(10)
    budget.headroom, budget.max_wait_seconds = 0.0, 0.2
    old = [list(range(100 * c, 100 * c + 16)) for c in range(2)]
    for tokens in old:
        assert rig.save_chain(tokens) == [SaveStatus.PUBLISHED] * 8
    admit, verdicts = budget.admit, []

    def first_waits_out_another_eviction(*args, **kwargs) -> bool:
        verdicts.append(admit(*args, **kwargs))
        if len(verdicts) == 1:
            budget._evicting.release()  # that other eviction ends just after the first gave up
        return verdicts[-1]

    budget.admit = first_waits_out_another_eviction
    rig.xfer.depth = 1  # one transfer thread: the chain's blocks in order, two to a slice
    assert budget._evicting.acquire(timeout=5)
    keys = chain_keys(list(range(9000, 9008)), TPB)  # 4 blocks: slices of 2 on the one thread
    items = [(k, keys[i - 1] if i else None, [torch.full((PAGE,), i, dtype=torch.uint8)]) for i, k in enumerate(keys)]
    assert [f.result() for f in rig.xfer.save_pages(0, items, _Ready())] == [SaveStatus.DROPPED] * 4
    assert verdicts == [False] * 4
    assert rig.ns.counters["evicted"] == 0
    assert all(all(rig.ns.contains_many(0, chain_keys(tokens, TPB))) for tokens in old)
    assert len(rig.xfer._saving) == 0


def test_a_block_two_requests_post_stays_on_its_way_while_one_copy_is(rig: _Rig) -> None:
    """Two requests of a step post the same block. The first request's copy is refused (its
    eviction waited out another's) while the second's is still to come: the block is still on
    its way for the second request's children, which the budget makes room for. (The first
    copy's refusal used to forget the block for both: the second chain's children were dropped
    as orphans although their parent landed.)"""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=16 * CHUNK))
    assert budget.counted.wait(10)
    budget.headroom, budget.max_wait_seconds = 0.0, 0.2
    for tokens in (list(range(100 * c, 100 * c + 16)) for c in range(2)):
        assert rig.save_chain(tokens) == [SaveStatus.PUBLISHED] * 8
    gate = threading.Event()

    class Gated:
        def synchronize(self) -> None:
            assert gate.wait(10)

    rig.xfer.depth = 1  # one transfer thread a batch: the chain's blocks in order, two to a slice
    keys = chain_keys(list(range(9000, 9008)), TPB)
    items = [(k, keys[i - 1] if i else None, [torch.full((PAGE,), i, dtype=torch.uint8)]) for i, k in enumerate(keys)]
    second = rig.xfer.save_pages(0, items, Gated())
    assert budget._evicting.acquire(timeout=5)  # another thread's eviction, which the first copy waits out
    try:
        assert rig.xfer.save_pages(0, items[:1], _Ready())[0].result(timeout=10) is SaveStatus.DROPPED
    finally:
        budget._evicting.release()
    gate.set()
    assert [f.result(timeout=10) for f in second] == [SaveStatus.PUBLISHED] * 4
    assert rig.ns.counters["saves_dropped_budget"] == 1
    assert all(rig.ns.contains_many(0, keys)) and rig.stored_bytes() <= 16 * CHUNK
    assert len(rig.xfer._saving) == 0, "finished saves are forgotten"


def test_chunks_used_since_the_index_saw_them_cost_a_second_ranking_not_the_save(rig: _Rig,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads set a chunk's mtime after its lookup journaled its recency, and other processes' loads
    are not in this process's index at all: the victims the index ranks least recent are found
    used on disk and kept. The eviction ranks again with their true recency (journaled as they
    were kept) and makes room. (It used to give up after that first look: the save was dropped,
    and so was every save after it while the index lagged.)"""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=8 * CHUNK))
    assert budget.counted.wait(10)
    budget.headroom = 0.0
    a, b = list(range(8)), list(range(100, 108))
    assert rig.save_chain(a) + rig.save_chain(b) == [SaveStatus.PUBLISHED] * 8
    assert budget._count(walk=False) is not None  # the index has them all, with their save times
    later = time.time_ns() + 10**9
    for k in chain_keys(a, TPB) + chain_keys(b, TPB):  # used since, as another process's loads do
        os.utime(rig.ns.chunk_path(0, k), ns=(time.time_ns(), later))  # no lease: an atime not ahead
    reads, read = [], ev.catalog.read
    monkeypatch.setattr(ev.catalog, "read", lambda store: reads.append(store) or read(store))
    assert rig.save_chain([500, 501]) == [SaveStatus.PUBLISHED]
    assert rig.ns.counters["saves_dropped_budget"] == 0 and rig.ns.counters["evicted"] == 1
    assert rig.stored_bytes() <= 8 * CHUNK
    assert len(reads) == 1, "the second ranking is made on the table already read, less what was removed"


def test_room_an_eviction_makes_is_not_taken_by_saves_admitted_meanwhile(rig: _Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves posted from the serving loop (and the remote tier's replies) are admitted without
    waiting for the eviction lock. Those admitted while another save's eviction runs take only
    what it frees beyond that save's own room. (They used to take that room too: the save that
    evicted was then refused, and a prefix read through from the remote tier was cut short.)"""
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=16 * CHUNK))
    assert budget.counted.wait(10)
    budget.headroom = 2 / 16  # an eviction frees the save's room and two chunks more
    for tokens in (list(range(100 * c, 100 * c + 16)) for c in range(2)):
        assert rig.save_chain(tokens) == [SaveStatus.PUBLISHED] * 8
    evict, taken = budget.evict, []

    def others_admitted_meanwhile(need: int, protect=()):
        done = evict(need, protect)
        other = threading.Thread(target=lambda: taken.append(budget.admit_now(CHUNK, count=4)))
        other.start()  # as a step's saves or a remote reply would, between the removal and this save
        other.join()
        return done

    monkeypatch.setattr(budget, "evict", others_admitted_meanwhile)
    assert rig.save_chain([500, 501]) == [SaveStatus.PUBLISHED]
    assert taken == [2], "the others got what was freed beyond the save's room"
    assert rig.ns.counters["saves_dropped_budget"] == 0 and rig.ns.counters["evicted"] == 3
    assert rig.stored_bytes() <= 16 * CHUNK and budget.used_bytes == 16 * CHUNK


def test_a_save_found_stored_already_gives_its_reservation_back(rig: _Rig) -> None:
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=10 * CHUNK))
    assert budget.counted.wait(10)
    tokens = list(range(8))
    assert rig.save_chain(tokens) == [SaveStatus.PUBLISHED] * 4
    used = budget.used_bytes
    assert used == 4 * CHUNK
    assert rig.save_chain(tokens) == [SaveStatus.EXISTS] * 4
    assert budget.used_bytes == used


def test_budget_evicts_least_recent_chain_first(rig: _Rig) -> None:
    install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=8 * CHUNK))
    rig.store.budget.headroom = 0.0
    a, b = list(range(8)), list(range(100, 108))
    rig.save_chain(a)
    rig.save_chain(b)
    rig.ns.touch_many(0, chain_keys(a, TPB))  # a is now the recent one
    rig.save_chain(list(range(200, 204)))  # 2 blocks: must evict 2 of b, deepest first
    keys_a, keys_b = chain_keys(a, TPB), chain_keys(b, TPB)
    assert all(rig.ns.contains_many(0, keys_a))
    assert rig.ns.contains_many(0, keys_b) == [True, True, False, False]


def test_pinned_chunks_are_not_evicted_and_a_full_store_drops(rig: _Rig) -> None:
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=4 * CHUNK))
    budget.headroom = 0.0
    a = list(range(8))
    rig.save_chain(a)
    keys = chain_keys(a, TPB)
    tip = rig.ns.chunk_path(0, keys[-1])
    budget.pin(tip)
    status = rig.save_chain([500, 501])
    assert status == [SaveStatus.DROPPED]
    assert rig.ns.counters["saves_dropped_budget"] == 1
    assert all(rig.ns.contains_many(0, keys))
    budget.unpin(tip)
    assert rig.save_chain([500, 501]) == [SaveStatus.PUBLISHED]
    assert rig.ns.contains_many(0, keys) == [True, True, True, False]


def test_a_save_never_evicts_its_own_parent(rig: _Rig) -> None:
    install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=3 * CHUNK))
    tokens = list(range(10))  # 5 blocks, room for 3
    status = rig.save_chain(tokens)
    assert status[:3] == [SaveStatus.PUBLISHED] * 3
    assert status[3:] == [SaveStatus.DROPPED] * 2
    assert rig.ns.contains_many(0, chain_keys(tokens, TPB)) == [True, True, True, False, False]


def test_free_space_floor(rig: _Rig) -> None:
    capacity = 20 * CHUNK

    def fake_usage(path: str) -> tuple[int, int]:
        return capacity, capacity - rig.stored_bytes()

    budget = Budget(rig.store, Limits(min_free_percent=50.0), headroom=0.0, disk_usage=fake_usage, block_size=1)  # a disk of bytes
    rig.store.budget = budget
    for p in range(6):
        rig.save_chain([1000 * p + t for t in range(6)])
        assert fake_usage("")[1] >= capacity // 2
    assert rig.ns.counters["evicted"] > 0


def test_a_steps_saves_ask_the_floor_once_and_take_the_room_there_is(rig: _Rig) -> None:
    """``admit_now`` for a slice asks the file system once and admits the first pages that fit;
    a step of saves posted on a store at its floor goes to a transfer thread, which evicts for it."""
    capacity, asked = 20 * CHUNK, []

    def fake_usage(path: str) -> tuple[int, int]:
        asked.append(path)
        return capacity, capacity - rig.stored_bytes()

    budget = Budget(rig.store, Limits(min_free_percent=50.0), headroom=0.0, disk_usage=fake_usage, block_size=1)
    rig.store.budget = budget
    budget.refresh()  # the store counted (and indexed) now, not by a background thread during the test
    budget._counted_at = budget.clock()
    asked.clear()
    assert budget.admit_now(CHUNK, 4) == 4 and len(asked) == 1
    assert budget.admit_now(CHUNK, 20) == 6 and len(asked) == 2
    assert budget.admit_now(CHUNK) == 0
    for _ in range(10):
        budget.on_present(CHUNK)  # nothing was written: the reservations end
    assert rig.save_chain(list(range(20))) == [SaveStatus.PUBLISHED] * 10  # the store at its floor
    keys = chain_keys(list(range(1000, 1012)), TPB)
    futures = rig.xfer.save_pages(0, [(k, None, [torch.full((PAGE,), i, dtype=torch.uint8)]) for i, k in enumerate(keys)])
    assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 6
    assert rig.stored_bytes() <= capacity // 2
    assert rig.ns.counters["evicted"] >= 6


def test_eviction_order_survives_reopen_through_mtime(tmp_path: Path) -> None:
    r = _Rig(tmp_path / "s")
    old, new = list(range(4)), list(range(50, 54))
    r.save_chain(old)
    r.save_chain(new)
    past = time.time_ns() - 10**12
    for k in chain_keys(old, TPB):
        os.utime(r.ns.chunk_path(0, k), ns=(past, past))
    r.close()
    store = PageStore.open(tmp_path / "s")
    table = scan_store(store)
    victims = select_victims(table, 2 * CHUNK)
    gone = {table.path(int(v)) for v in victims}
    ns = store.namespaces()[0]
    assert gone == {ns.chunk_path(0, k) for k in chain_keys(old, TPB)}


def test_a_budget_without_limits_admits_every_save_and_journals_it(rig: _Rig) -> None:
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root)))
    assert rig.store.budget is budget and not budget.evicts
    assert budget.refresh_seconds == UNLIMITED_REFRESH_S  # its counts are seldom: nothing waits on them
    assert rig.save_chain(list(range(40 * TPB))) == [SaveStatus.PUBLISHED] * 40
    assert catalog.totals(rig.store).chunks == 40  # journaled as a budget's saves are


def test_bring_up_without_limits_does_not_wait_for_the_count(rig: _Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing a process without a limit does depends on the count: its bring-up never waits for
    one, however long the index takes (a store without one is walked)."""
    counting = threading.Event()
    release = threading.Event()
    real = catalog.totals

    def slow_totals(store: PageStore) -> catalog.Summary:
        counting.set()
        release.wait(60)
        return real(store)

    monkeypatch.setattr(catalog, "totals", slow_totals)
    done = threading.Event()
    t = threading.Thread(target=lambda: (install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root)),
                                                        wait_seconds=60), done.set()))
    t.start()
    try:
        assert counting.wait(10) and done.wait(10)
    finally:
        release.set()
        t.join()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops(), budget_chunks=st.integers(2, 10))
def test_property_real_store(ops: list[tuple], budget_chunks: int) -> None:
    """The same property through PageTransfer + Budget on a real store: saves in prefix order,
    touches, and ``gdskv evict``-style evictions."""
    with tempfile.TemporaryDirectory() as d:
        r = _Rig(Path(d) / "s")
        install_budget(r.store, GdsKvConfig(store_path=str(r.store.root), max_bytes=budget_chunks * CHUNK))
        chains: list[list[int]] = []
        parent_of: dict[bytes, bytes | None] = {}
        try:
            for n, op in enumerate(ops):
                if op[0] == "new" or not chains:
                    src = chains[op[1] % len(chains)] if chains and op[0] == "new" else []
                    fork = op[2] * TPB if op[0] == "new" else 0
                    extra = (op[3] if op[0] == "new" else 3) * TPB
                    toks = src[:fork] + [10_000 * (n + 1) + t for t in range(extra)]
                    chains.append(toks)
                    keys = chain_keys(toks, TPB)
                    parent_of.update({k: keys[i - 1] if i else None for i, k in enumerate(keys)})
                    continue
                toks = chains[op[1] % len(chains)]
                keys = chain_keys(toks, TPB)
                present = r.ns.contains_many(0, keys)
                first = present.index(False) if False in present else len(keys)
                if op[0] == "save" and first < len(keys):
                    page = torch.zeros(PAGE, dtype=torch.uint8)
                    r.xfer.save_page(0, keys[first], keys[first - 1] if first else None, [page]).result()
                elif op[0] == "touch":
                    r.ns.touch_many(0, keys[:first])
                elif op[0] == "evict":
                    table = scan_store(r.store)
                    ev.remove_chunks(r.store, table, select_victims(table, op[1] * CHUNK))
                stored = {k for k in parent_of if r.ns.contains(0, k)}
                _no_orphans(parent_of, stored)
                assert r.stored_bytes() <= budget_chunks * CHUNK
        finally:
            r.close()


def test_concurrent_saves_stay_within_budget(tmp_path: Path) -> None:
    r = _Rig(tmp_path / "s")
    r.xfer.close()
    r.xfer = PageTransfer(r.ns, r.engine, threads=8)
    install_budget(r.store, GdsKvConfig(store_path=str(r.store.root), max_bytes=12 * CHUNK))
    futs = []
    for p in range(20):
        keys = chain_keys([100 * p + t for t in range(8)], TPB)
        futs += [r.xfer.save_page(0, k, keys[i - 1] if i else None, [torch.zeros(PAGE, dtype=torch.uint8)]) for i, k in enumerate(keys)]
    statuses = [f.result() for f in futs]
    assert SaveStatus.PUBLISHED in statuses
    assert r.stored_bytes() <= 12 * CHUNK
    r.close()


def test_a_save_does_not_wait_long_for_another_eviction(rig: _Rig) -> None:
    budget = install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=2 * CHUNK))
    rig.save_chain(list(range(4)))
    budget.max_wait_seconds = 0.05
    with budget._evicting:  # another thread is evicting
        t0 = time.monotonic()
        assert rig.save_chain([900, 901]) == [SaveStatus.DROPPED]
        assert time.monotonic() - t0 < 1.0


def test_a_lookup_lease_keeps_chunks_until_their_load(rig: _Rig) -> None:
    """A connector's lookup leases the chunks it promised (their atime lies ahead): eviction in
    any process, inline or `gdskv evict`, leaves them and their ancestors alone until it runs out."""
    leased = [10 + t for t in range(4 * TPB)]
    rig.save_chain(leased)
    keys = chain_keys(leased, TPB)
    assert rig.ns.touch_many(0, keys[:2], lease_seconds=60) == 2
    install_budget(rig.store, GdsKvConfig(store_path=str(rig.store.root), max_bytes=3 * CHUNK))
    for p in range(3):
        rig.save_chain([1000 * p + t for t in range(4 * TPB)])
    assert rig.ns.contains_many(0, keys[:2]) == [True, True], "leased prefix survives inline eviction"
    assert rig.stored_bytes() <= 3 * CHUNK
    res = CliRunner().invoke(cli_main, ["--store", str(rig.store.root), "evict", "--max-bytes", "0", "--json"])
    assert res.exit_code in (0, 1), res.output
    assert rig.ns.contains_many(0, keys[:2]) == [True, True], "and `gdskv evict`"
    past = time.time_ns() - 1
    for k in keys[:2]:  # the lease runs out
        os.utime(rig.ns.chunk_path(0, k), ns=(past, past))
    CliRunner().invoke(cli_main, ["--store", str(rig.store.root), "evict", "--max-bytes", "0", "--json"])
    assert rig.ns.contains_many(0, keys[:2]) == [False, False]


def test_the_free_space_floor_counts_whole_file_system_blocks() -> None:
    """Issue 9, defect 11: a chunk of 4097 bytes takes two 4 KiB blocks; counting 4097 bytes
    against the floor undershot it by one block on ext4."""
    limits = Limits(min_free_bytes=100_000)
    assert shortfall(limits, used=0, fs_total=10**9, fs_free=100_000 + 4097, incoming=4097) == 0
    assert shortfall(limits, used=0, fs_total=10**9, fs_free=100_000 + 4097, incoming=4097, block=4096) == 8192 - 4097
    assert shortfall(limits, used=0, fs_total=10**9, fs_free=100_000 + 8192, incoming=4097, block=4096) == 0


def test_no_room_names_the_limit_that_leaves_no_room_for_one_chunk():
    from gdskv.eviction import Limits, no_room

    chunk = 4096 + 128
    assert "max_bytes" in no_room(Limits(max_bytes=chunk - 1), 10**12, 4096)
    assert no_room(Limits(max_bytes=chunk), 10**12, 4096) is None
    assert "free-space floor" in no_room(Limits(min_free_bytes=10**12), 10**12, 4096)
    assert "free-space floor" in no_room(Limits(min_free_percent=99.99999999), 10**9, 4096)
    assert no_room(Limits(min_free_percent=50.0), 10**9, 4096) is None
