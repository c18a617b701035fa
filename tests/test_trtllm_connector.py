"""GdsKvScheduler / GdsKvWorker driven directly, with small fake requests, on a real store in tmp_path.

Each test plays the runtime: lookup, allocation, ``build_connector_meta`` (pickled, as the
broadcast does), the worker's per-layer hooks, ``get_finished``, ``request_finished``.
"""
from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

from gdskv.connectors.trtllm import ConnectorSetupError, GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine.requests import RequestData, SchedulerOutput
from gdskv.keys import chain_keys
from gdskv.layout import BAD_PAGE_INDEX, GroupPools, KvCacheBufferRef, layout_from_group_tensors, single_pool_layout
from gdskv.planner import ConnectorMetadata

TPB = 4
MODEL = "test/model"


@dataclass
class FakeRequest:
    """The ``LlmRequest`` surface the scheduler reads."""

    request_id: int
    tokens: list[int]
    cache_salt: Optional[str] = None

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = str(tmp_path / "store")
    monkeypatch.setenv("GDSKV_STORE", path)
    return path


def args(tp_rank: int = 0, tp_size: int = 1, **over: Any) -> StandaloneLlmArgs:
    a = StandaloneLlmArgs.build(MODEL, TPB, tp_rank, tp_size)
    for k, v in over.items():
        setattr(a, k, v)
    return a


def single_pool(num_slots: int = 16, num_layers: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, num_layers, 2, TPB * 8, generator=g)


def two_group_layout(num_slots: int = 16, seed: int = 0, window: int = 64):
    """VSWA-like: group 0 full attention (layers 0, 2), group 1 sliding (layers 1, 3); two regions
    (K and V) per group."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for w, layers in ((None, (0, 2)), (window, (1, 3))):
        k, v = (torch.randn(num_slots, 2, TPB * 8, generator=g) for _ in range(2))
        groups.append(GroupPools(w, layers, [k, v], [[KvCacheBufferRef(l, "key") for l in layers], [KvCacheBufferRef(l, "value") for l in layers]]))
    return layout_from_group_tensors(groups, TPB, torch.float32)


def page(layout, gid: int, slot: int) -> bytes:
    return b"".join(r.slot_tensor(slot).numpy().tobytes() for r in layout.group(gid).regions)


@dataclass
class Runtime:
    """Plays TensorRT-LLM's side for one scheduler and its workers."""

    scheduler: GdsKvScheduler
    workers: list[GdsKvWorker]
    num_layers: int
    per_group: bool = True
    reported: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    external_loads: dict[int, int] = field(default_factory=dict)
    """Tokens the connector offered, left out of a request's first ``computed_position`` as
    TensorRT-LLM's ``build_scheduler_output`` does."""

    def admit(self, req: FakeRequest, pages: list[list[int]]) -> int:
        n, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert is_async is False
        self.external_loads[req.request_id] = n
        if self.per_group:
            self.scheduler.update_state_after_alloc_by_layer_group(req, pages)
        else:
            self.scheduler.update_state_after_alloc(req, pages[0])
        return n

    def data(self, req: FakeRequest, pages: list[list[int]], computed: int, scheduled: int) -> tuple[bool, RequestData]:
        first = req.request_id not in self.reported
        if first:
            computed -= self.external_loads.pop(req.request_id, 0)
        seen_tokens, seen_pages = self.reported.get(req.request_id, (0, [0] * len(pages)))
        delta = [ids[s:] for ids, s in zip(pages, seen_pages)]
        self.reported[req.request_id] = (len(req.tokens), [len(ids) for ids in pages])
        return first, RequestData(
            req.request_id, req.tokens[seen_tokens:], list(delta[0]) if len(pages) == 1 else [], delta,
            computed, scheduled, cache_salt=req.cache_salt,
        )

    def step(self, entries: list[tuple[FakeRequest, list[list[int]], int, int]], compute=None) -> ConnectorMetadata:
        out = SchedulerOutput()
        for req, pages, computed, scheduled in entries:
            first, d = self.data(req, pages, computed, scheduled)
            (out.new_requests if first else out.cached_requests).append(d)
        meta = self.scheduler.build_connector_meta(out)
        blob = pickle.dumps(meta)
        for w in self.workers:
            w.bind_connector_meta(pickle.loads(blob))
            w.start_load_kv(None)
        for layer in range(self.num_layers):
            for w in self.workers:
                w.wait_for_layer_load(layer, None)
            if compute is not None:
                compute(layer)
            for w in self.workers:
                w.save_kv_layer(layer, None)
        for w in self.workers:
            w.wait_for_save(None)
        return meta

    def finish(self, req: FakeRequest, pages: list[list[int]], timeout: float = 10.0) -> bool:
        """``request_finished``; when it says a save is under way, poll every worker's
        ``get_finished`` (the id given once, as the runtime does) until each reports it."""
        saving = (self.scheduler.request_finished_by_layer_group(req, pages) if self.per_group
                  else self.scheduler.request_finished(req, pages[0]))
        if saving:
            deadline = time.monotonic() + timeout
            for w in self.workers:
                given = [req.request_id]
                while True:
                    saved, loaded = w.get_finished(given, [])
                    given = []
                    assert saved in ([], [req.request_id]) and not loaded
                    if saved:
                        break
                    assert time.monotonic() < deadline, "saves never finished"
                    time.sleep(0.002)
        return saving

    def close(self) -> None:
        for w in self.workers:
            w.close()


def make(layouts, tp_size: int = 1, per_group: bool = True, register_tensor: bool = False) -> Runtime:
    workers = [GdsKvWorker(args(r, tp_size)) for r in range(tp_size)]
    for w, layout in zip(workers, layouts):
        if register_tensor:
            w.register_kv_caches(layout.as_single_pool_tensor())
        else:
            w.register_kv_cache_layout(layout)
    layers = 1 + max(l for g in layouts[0].groups for l in g.layer_ids)
    return Runtime(GdsKvScheduler(args(0, tp_size)), workers, layers, per_group)


PROMPT = list(range(3, 26))  # 23 tokens: 5 full blocks, 5 servable


# --- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("per_group", [False, True], ids=["flat-set", "per-group-set"])
def test_flat_pool_saves_then_a_new_connector_restores_the_pages(store, per_group):
    layout = single_pool_layout(single_pool(seed=1), TPB)
    rt = make([layout], per_group=per_group, register_tensor=not per_group)
    req = FakeRequest(1, PROMPT)
    pages = [[3, 7, 1, 9, 4, 11]]
    assert rt.admit(req, pages) == 0
    meta = rt.step([(req, pages, 0, len(PROMPT))])
    assert [op.page_slot for _, op in meta.saves_of_group(0)] == [3, 7, 1, 9, 4]
    assert rt.finish(req, pages) is True
    rt.close()

    fresh = single_pool_layout(torch.zeros(16, 2, 2, TPB * 8), TPB)
    rt2 = make([fresh], per_group=per_group, register_tensor=not per_group)
    req2 = FakeRequest(2, PROMPT)
    pages2 = [[5, 6, 0, 2, 8, 10]]
    assert rt2.admit(req2, pages2) == 20
    meta2 = rt2.step([(req2, pages2, 20, 3)])
    assert not meta2.saves_of_group(0)
    for o in range(5):
        assert page(fresh, 0, pages2[0][o]) == page(layout, 0, pages[0][o])
    assert rt2.workers[0].counters.loads_loaded == 5
    assert (rt2.scheduler.counters.lookups, rt2.scheduler.counters.matched_tokens) == (1, 20)
    assert rt2.finish(req2, pages2) is False, "nothing was saved for it"
    rt2.close()


def test_two_groups_two_regions_round_trip_per_group(store):
    layout = two_group_layout(seed=2)
    rt = make([layout])
    req = FakeRequest(1, PROMPT)
    pages = [[3, 7, 1, 9, 4, 11], [12, 2, 5, 6, 8, 0]]
    rt.admit(req, pages)
    meta = rt.step([(req, pages, 0, len(PROMPT))])
    for g in (0, 1):
        assert [op.page_slot for _, op in meta.saves_of_group(g)] == pages[g][:5]
        assert all(op.layer_group_id == g for _, op in meta.saves_of_group(g))
    rt.finish(req, pages)
    rt.close()

    fresh = two_group_layout(seed=3)
    rt2 = make([fresh])
    pages2 = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert rt2.admit(FakeRequest(2, PROMPT), pages2) == 20
    rt2.step([(FakeRequest(2, PROMPT), pages2, 20, 3)])
    for g in (0, 1):
        for o in range(5):
            assert page(fresh, g, pages2[g][o]) == page(layout, g, pages[g][o]), (g, o)
    rt2.close()


def test_a_lookup_miss_is_zero_and_synchronous(store):
    rt = make([single_pool_layout(single_pool(), TPB)])
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(1, PROMPT), 0) == (0, False)
    rt.close()


def test_chunked_prefill_saves_every_full_block_from_cached_request_deltas(store):
    layout = single_pool_layout(single_pool(seed=4), TPB)
    rt = make([layout])
    req = FakeRequest(1, PROMPT)
    all_pages = [9, 8, 7, 6, 5, 4]
    rt.admit(req, [all_pages[:2]])
    saved = []
    for start in range(0, len(PROMPT), 6):  # chunks of 6: never block aligned
        end = min(start + 6, len(PROMPT))
        pages = [all_pages[: -(-end // TPB)]]
        meta = rt.step([(req, pages, start, end - start)])
        saved += [op.page_slot for _, op in meta.saves_of_group(0)]
    assert saved == all_pages[:5]
    assert rt.finish(req, pages) is True
    ns = rt.workers[0].namespace
    assert all(ns.contains_many(0, chain_keys(PROMPT, TPB)))
    rt.close()


def test_salted_request_does_not_hit_another_salts_blocks(store):
    rt = make([single_pool_layout(single_pool(), TPB)])
    req = FakeRequest(1, PROMPT, cache_salt="tenant-a")
    pages = [[0, 1, 2, 3, 4, 5]]
    rt.admit(req, pages)
    rt.step([(req, pages, 0, len(PROMPT))])
    rt.finish(req, pages)
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(2, PROMPT, "tenant-b"), 0) == (0, False)
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(3, PROMPT), 0) == (0, False)
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(4, PROMPT, "tenant-a"), 0) == (20, False)
    rt.close()


# --- asynchrony ----------------------------------------------------------------------------------

class GatedWrites:
    """Holds the I/O engine's writes until ``open()``: saves stay in flight as long as a test
    wants, on every path (per page, a native batch, a native batch started for later)."""

    def __init__(self, engine):
        self._gate = threading.Event()
        now, batch, later = engine.write_now, engine.write_chunks_now, engine.write_chunks_later
        engine.write_now = lambda *a, **k: (self._gate.wait(10), now(*a, **k))[1]
        engine.write_chunks_now = lambda *a, **k: (self._gate.wait(10), batch(*a, **k))[1]
        # returns at once, as the real one does; the writes start once let go
        engine.write_chunks_later = lambda *a: threading.Thread(target=lambda: self._gate.wait(10) and later(*a)).start()

    def open(self) -> None:
        self._gate.set()


def test_get_finished_reports_only_given_ids_and_only_after_publication(store):
    rt = make([single_pool_layout(single_pool(seed=5), TPB)])
    worker = rt.workers[0]
    gate = GatedWrites(worker.service.transfer.engine)
    req, other = FakeRequest(1, PROMPT), FakeRequest(2, [40] * 9)
    pages, pages_other = [[0, 1, 2, 3, 4, 5]], [[6, 7, 8]]
    rt.admit(req, pages)
    rt.admit(other, pages_other)
    rt.step([(req, pages, 0, len(PROMPT)), (other, pages_other, 0, 9)])
    assert rt.scheduler.request_finished_by_layer_group(req, pages) is True, "saves still read its pages"
    assert worker.get_finished([], [99]) == ([], [99]), "a load id with nothing in flight, given: reported"
    assert worker.get_finished([1], []) == ([], []), "in flight: not yet"
    ns = worker.namespace
    keys = chain_keys(PROMPT, TPB)
    assert not any(ns.contains_many(0, keys))
    gate.open()
    deadline = time.monotonic() + 10
    saved: list[int] = []
    while not saved:
        saved, _ = worker.get_finished([], [])
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert saved == [1], "request 2 was never given, so never returned"
    assert all(ns.contains_many(0, keys[:5])), "reported done only once every chunk is published"
    assert worker.get_finished([], []) == ([], []), "reported once"
    assert worker.get_finished([2], []) in (([2], []), ([], []))
    rt.close()


# --- tensor parallelism ----------------------------------------------------------------------------

def test_tp2_serves_a_block_only_when_both_shards_exist(store):
    layouts = [single_pool_layout(single_pool(seed=6 + r), TPB) for r in range(2)]
    rt = make(layouts, tp_size=2)
    req = FakeRequest(1, PROMPT)
    pages = [[0, 1, 2, 3, 4, 5]]
    rt.admit(req, pages)
    rt.step([(req, pages, 0, len(PROMPT))])
    rt.finish(req, pages)
    ns0, ns1 = (w.namespace for w in rt.workers)
    assert ns0.id != ns1.id and ns0.spec.tp_rank == 0 and ns1.spec.tp_rank == 1
    keys = chain_keys(PROMPT, TPB)
    assert all(ns0.contains_many(0, keys)) and all(ns1.contains_many(0, keys))
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(2, PROMPT), 0) == (20, False)
    ns1.remove(0, keys[3])
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(3, PROMPT), 0) == (12, False)
    ns1.remove(0, keys[0])
    assert rt.scheduler.get_num_new_matched_tokens(FakeRequest(4, PROMPT), 0) == (0, False)
    rt.close()


# --- poisoned slot --------------------------------------------------------------------------------

def test_the_slot_minus_one_aliases_is_never_read_or_written(store):
    num_slots = 12
    layout = two_group_layout(num_slots=num_slots, seed=7, window=9)
    for g in layout.groups:
        for r in g.regions:
            r.as_tensor()[num_slots - 1].fill_(0xFF)
    poison = page(layout, 0, num_slots - 1)
    rt = make([layout])
    req = FakeRequest(1, PROMPT)
    # chunked prefill of 8; the sliding group reports -1 in place for blocks its window passed
    pages = [[0, 1], [2, 3]]
    rt.admit(req, pages)
    rt.step([(req, pages, 0, 8)])
    pages = [[0, 1, 4, 5], [BAD_PAGE_INDEX, 3, 6, 7]]
    rt.step([(req, pages, 8, 8)])
    pages = [[0, 1, 4, 5, 8, 9], [BAD_PAGE_INDEX, BAD_PAGE_INDEX, BAD_PAGE_INDEX, 7, 10, 3]]
    rt.step([(req, pages, 16, 7)])
    rt.finish(req, pages)
    for g in layout.groups:
        assert page(layout, g.layer_group_id, num_slots - 1) == poison[: len(page(layout, g.layer_group_id, num_slots - 1))]
    # a load of everything the store has, into pools whose last slot is poisoned too
    fresh = two_group_layout(num_slots=num_slots, seed=8, window=9)
    for g in fresh.groups:
        for r in g.regions:
            r.as_tensor()[num_slots - 1].fill_(0xFF)
    before = [page(fresh, g, num_slots - 1) for g in (0, 1)]
    rt2 = make([fresh])
    req2 = FakeRequest(2, PROMPT)
    pages2 = [[0, 1, 2, 3, 4, 5], [BAD_PAGE_INDEX, BAD_PAGE_INDEX, 6, 7, 8, 9]]
    n = rt2.admit(req2, pages2)
    rt2.step([(req2, pages2, n, len(PROMPT) - n)])
    assert [page(fresh, g, num_slots - 1) for g in (0, 1)] == before
    for f in rt.workers[0].namespace.path.rglob("*"):
        if f.is_file() and "/c/" in str(f):
            assert b"\xff" * 64 not in f.read_bytes()
    rt.close()
    rt2.close()


# --- load failures ------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_a_corrupt_chunk_is_a_load_failure_and_nothing_computed_on_it_is_saved(store, tp):
    rt = make([single_pool_layout(single_pool(seed=9 + r), TPB) for r in range(tp)], tp_size=tp)
    req = FakeRequest(1, PROMPT[:13])  # 3 full blocks
    pages = [[0, 1, 2, 3]]
    rt.admit(req, pages)
    rt.step([(req, pages, 0, 13)])
    rt.finish(req, pages)
    ns = rt.workers[-1].namespace  # the last rank's shard is the bad one
    keys = chain_keys(PROMPT, TPB)
    path = ns.chunk_path(0, keys[1])
    raw = bytearray(open(path, "rb").read())
    raw[5] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    rt.close()

    rt2 = make([single_pool_layout(single_pool(seed=20 + r), TPB) for r in range(tp)], tp_size=tp)
    req2 = FakeRequest(2, PROMPT)
    pages2 = [[0, 1, 2, 3, 4, 5]]
    assert rt2.admit(req2, pages2) == 12, "presence is a stat; the checksum is checked at load"
    meta = rt2.step([(req2, pages2, 12, 11)])
    assert len(meta.saves_of_group(0)) == 2
    assert [w.get_load_failures() for w in rt2.workers] == [[]] * (tp - 1) + [[2]]
    assert rt2.workers[-1].get_load_failures() == []
    # no rank saves KV computed on top of a failed load, whichever rank's load failed
    assert [w.counters.saves_suppressed for w in rt2.workers] == [2] * tp
    assert not any(w.namespace.contains_many(0, keys[3:5])[i] for w in rt2.workers for i in range(2))
    assert not ns.contains(0, keys[1]), "the corrupt chunk was quarantined"
    rt2.close()


def test_a_prefill_past_a_loaded_prefix_saves_its_new_blocks_in_that_step(store):
    """TensorRT-LLM leaves the tokens the connector offered out of a request's first
    ``computed_position``: the KV at the end of that step still reaches the prompt's end, so the
    blocks past the loaded prefix are saved in that step, and a request that ends right after its
    prefill (prewarm, classification: max_tokens=1) does not lose them."""
    rt = make([single_pool_layout(single_pool(seed=1), TPB)])
    req = FakeRequest(1, PROMPT)  # 5 full blocks stored
    rt.admit(req, [[0, 1, 2, 3, 4, 5]])
    rt.step([(req, [[0, 1, 2, 3, 4, 5]], 0, len(PROMPT))])
    assert rt.finish(req, [[0, 1, 2, 3, 4, 5]])
    longer = list(range(3, 34))  # 31 tokens: the same 5 blocks, then 2 more full ones
    req2 = FakeRequest(2, longer)
    pages2 = [[6, 7, 8, 9, 10, 11, 12, 13]]
    assert rt.admit(req2, pages2) == 20
    meta = rt.step([(req2, pages2, 20, 11)])  # reported to the connector as computed_position 0
    assert [op.page_slot for _, op in meta.saves_of_group(0)] == [11, 12]
    assert [op.page_slot for _, op in meta.loads_of_group(0)] == [6, 7, 8, 9, 10]
    assert rt.finish(req2, pages2)
    assert rt.workers[0].namespace.contains_many(0, chain_keys(longer, TPB)) == [True] * 7
    rt.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_without_a_recompute_hook_nothing_a_failed_load_request_computes_later_is_saved(store, tp):
    """TensorRT-LLM has no hook to recompute a request whose load failed: it runs on, and the
    blocks it completes in later steps stand on KV that is not its own. None is saved, on any
    rank, until it finishes; a later request with the same tokens saves them."""
    rt = make([single_pool_layout(single_pool(seed=9 + r), TPB) for r in range(tp)], tp_size=tp)
    req = FakeRequest(1, PROMPT[:13])
    rt.admit(req, [[0, 1, 2, 3]])
    rt.step([(req, [[0, 1, 2, 3]], 0, 13)])
    rt.finish(req, [[0, 1, 2, 3]])
    ns = rt.workers[-1].namespace
    keys = chain_keys(PROMPT + [99], TPB)
    raw = bytearray(open(ns.chunk_path(0, keys[1]), "rb").read())
    raw[5] ^= 0xFF
    open(ns.chunk_path(0, keys[1]), "wb").write(bytes(raw))
    rt.close()

    rt2 = make([single_pool_layout(single_pool(seed=20 + r), TPB) for r in range(tp)], tp_size=tp)
    req2 = FakeRequest(2, list(PROMPT))
    pages2 = [[0, 1, 2, 3, 4, 5, 6]]
    assert rt2.admit(req2, pages2) == 12
    rt2.step([(req2, pages2, 12, 11)])  # the load fails; blocks 3 and 4 complete: not saved
    req2.tokens.append(99)
    rt2.step([(req2, pages2, 23, 1)])  # a decode step completes block 5: not saved either
    assert [w.counters.saves_suppressed for w in rt2.workers] == [3] * tp
    assert not any(w.namespace.contains_many(0, keys[3:6])[i] for w in rt2.workers for i in range(3))
    assert rt2.finish(req2, pages2)
    req3 = FakeRequest(3, PROMPT + [99])
    rt2.admit(req3, [[7, 8, 9, 10, 11, 12, 13]])
    rt2.step([(req3, [[7, 8, 9, 10, 11, 12, 13]], 0, 24)])
    rt2.finish(req3, [[7, 8, 9, 10, 11, 12, 13]])
    assert all(w.namespace.contains_many(0, keys[:6]) == [True] * 6 for w in rt2.workers)
    rt2.close()


# --- bring-up -----------------------------------------------------------------------------------

@pytest.mark.parametrize("over, setting", [
    ({"max_beam_width": 2}, "max_beam_width"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
])
def test_bring_up_refuses_settings_by_name(store, over, setting):
    for cls in (GdsKvScheduler, GdsKvWorker):
        with pytest.raises(ConnectorSetupError, match=setting):
            cls(args(**over))


def test_bring_up_refuses_block_reuse_off(store):
    a = args()
    a.kv_cache_config.enable_block_reuse = False
    with pytest.raises(ConnectorSetupError, match="enable_block_reuse"):
        GdsKvScheduler(a)


@dataclass
class _Region:
    base: int = 0
    size: int = 64
    stride: int = 64
    num_slots: int = 4

    def slot_tensor(self, slot: int, dtype=torch.uint8):
        return torch.zeros(self.size, dtype=dtype)


@dataclass
class _Group:
    layer_group_id: int = 0
    window_size: Optional[int] = None
    layer_ids: tuple = (0,)
    regions: tuple = (_Region(),)

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)


@dataclass
class _NoSlotTensor:
    base: int = 0
    size: int = 64
    stride: int = 64
    num_slots: int = 4


@dataclass
class _ReplicatedGroup(_Group):
    replicated_regions: tuple = (_Region(size=16, stride=16),)


@dataclass
class _Layout:
    tokens_per_block: int = TPB
    dtype: Any = torch.float32
    groups: tuple = (_Group(),)


@pytest.mark.parametrize("layout, words", [
    (_Layout(groups=()), "no layer groups"),
    (_Layout(groups=(_Group(regions=(_Region(size=128, stride=64),)),)), "does not fit in stride"),
    (_Layout(groups=(_Group(regions=()),)), "no regions"),
    (_Layout(groups=(_Group(layer_group_id=1),)), "dense from 0"),
    (_Layout(groups=(_Group(), _Group(layer_group_id=1))), "layer 0 is in layer groups 0 and 1"),
    (_Layout(tokens_per_block=8), "kv_cache_config.tokens_per_block"),
    (_Layout(dtype=None), "layout.dtype"),
    (_Layout(groups=(_Group(regions=(_NoSlotTensor(),)),)), "KvCacheRegion.slot_tensor"),
    (_Layout(groups=(_ReplicatedGroup(),)), "replicated region"),
])
def test_a_layout_gdskv_cannot_describe_fails_at_registration_naming_it(store, layout, words):
    with pytest.raises(ConnectorSetupError, match=words):
        GdsKvWorker(args()).register_kv_cache_layout(layout)


def test_a_duck_typed_foreign_layout_registers(store):
    w = GdsKvWorker(args())
    w.register_kv_cache_layout(_Layout(groups=(_Group(), _Group(1, 32, (1,), (_Region(), _Region(size=32, stride=96))))))
    assert [g.bytes_per_page for g in w.namespace.spec.groups] == [64, 96]
    w.close()


def test_another_geometry_is_another_namespace_and_is_logged(store, caplog):
    w1 = GdsKvWorker(args())
    w1.register_kv_caches(single_pool(num_layers=2))
    with caplog.at_level(logging.INFO, logger="gdskv"):
        w2 = GdsKvWorker(args())
        w2.register_kv_caches(single_pool(num_layers=3))
    assert w1.namespace.id != w2.namespace.id
    assert w1.namespace.id in caplog.text
    w1.close()
    w2.close()


def test_an_unusable_store_degrades_to_recompute_without_raising(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("GDSKV_STORE", str(blocker / "store"))
    rt = make([single_pool_layout(single_pool(), TPB)])
    req = FakeRequest(1, PROMPT)
    pages = [[0, 1, 2, 3, 4, 5]]
    assert rt.admit(req, pages) == 0
    meta = rt.step([(req, pages, 0, len(PROMPT))])
    assert meta.plans == ()
    assert rt.finish(req, pages) is False
    rt.close()


def test_a_store_that_vanishes_while_serving_degrades_without_raising(store):
    import shutil

    rt = make([single_pool_layout(single_pool(seed=11), TPB)])
    req = FakeRequest(1, PROMPT)
    pages = [[0, 1, 2, 3, 4, 5]]
    rt.admit(req, pages)
    rt.step([(req, pages, 0, len(PROMPT))])
    rt.finish(req, pages)
    shutil.rmtree(store)
    req2 = FakeRequest(2, PROMPT + [1, 2, 3, 4, 5])
    pages2 = [[6, 7, 8, 9, 10, 11, 12]]
    assert rt.admit(req2, pages2) == 0
    rt.step([(req2, pages2, 0, len(req2.tokens))])
    rt.finish(req2, pages2)
    rt.close()


def test_per_layer_group_pair_alone_is_a_complete_scheduler():
    """The spec: implementing the per-layer-group form of a pair is enough."""
    from gdskv.connectors.trtllm.base import KvCacheConnectorScheduler

    class PerGroupOnly(KvCacheConnectorScheduler):
        def build_connector_meta(self, scheduler_output):
            return None

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group):
            self.seen = block_ids_by_layer_group

        def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group):
            return False

    s = PerGroupOnly(None)
    s.update_state_after_alloc_by_layer_group(None, [[1], [2]])
    assert s.seen == [[1], [2]]
    with pytest.raises(NotImplementedError, match="update_state_after_alloc"):
        s.update_state_after_alloc(None, [1])


def test_the_store_byte_budget_holds_under_the_connector(store, tmp_path, monkeypatch):
    """max_bytes from gdskv's config bounds what a serving run leaves in the store."""
    from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
    from gdskv.store import PageStore

    model = ModelConfig(num_layers=2)
    page_bytes = 2 * 2 * TPB * model.num_kv_heads * model.head_dim * 4
    budget = 6 * (page_bytes + 128)
    cfg = tmp_path / "gdskv.toml"
    cfg.write_text(f"max_bytes = {budget}\n")
    monkeypatch.setenv("GDSKV_CONFIG", str(cfg))
    worker = GdsKvWorker(StandaloneLlmArgs.build(model.fingerprint(), TPB))
    engine = ReferenceEngine(model, EngineConfig(tokens_per_block=TPB), GdsKvScheduler(StandaloneLlmArgs.build(model.fingerprint(), TPB)), [worker])
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # a step's saves are admitted together; the second run's make room by evicting the first's
        engine.generate([torch.randint(0, model.vocab_size, (4 * TPB + 1,), generator=g).tolist() for _ in range(4)], 1)
    worker.close()
    used = sum(e.stat().st_size for _, _, e in PageStore.open(store).iter_chunk_files())
    assert 0 < used <= budget
    assert worker.counters.saves_published > 6  # more was saved than fits: eviction made room
