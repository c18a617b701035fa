"""No per-request state outlives its request: ``RequestTable`` and the schedulers and workers on it.

Thousands of requests that were looked up and never scheduled (cancelled, rejected) go through
gdskv's TensorRT-LLM and vLLM scheduler halves on a real store with stored prefixes (so every
lookup hits and leases): their state is dropped once ``unscheduled_ttl_s`` has passed, the maps
stay bounded and traced memory stays flat. Requests that run, finish, or are aborted while their
asynchronous load is in flight leave nothing behind in the scheduler, the workers or the engine.
"""
from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Optional

import pytest
import torch

from gdskv.config import GdsKvConfig
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
from gdskv.request_state import RequestTable
from test_trtllm_connector import FakeRequest

TPB = 4
MODEL = ModelConfig(num_layers=2, seed=3)
TTL = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_table_expires_only_unscheduled_entries_in_order():
    clock = Clock()
    table: RequestTable[int, str] = RequestTable(10.0, clock)
    table.put(1, "a")
    clock.now = 4
    table.put(2, "b")
    table.put(3, "c")
    table.mark_scheduled(3)
    clock.now = 10.5
    assert table.expire() == [1] and 1 not in table and len(table) == 2
    clock.now = 100
    table.put(4, "d", scheduled=True)
    assert table.expire() == [2] and sorted(table) == [3, 4] and table.unscheduled == 0
    assert table.pop(3) == "c" and table.pop(3) is None and len(table) == 1
    with pytest.raises(ValueError, match="unscheduled_ttl_s"):
        RequestTable(0)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stack(store: str, threshold: Optional[int] = 0) -> tuple[ReferenceEngine, GdsKvScheduler, GdsKvWorker]:
    cfg = GdsKvConfig(store_path=store, async_load_min_bytes=threshold)
    args = StandaloneLlmArgs.build(MODEL.fingerprint(), TPB)
    scheduler, worker = GdsKvScheduler(args, config=cfg, unscheduled_ttl_s=TTL), GdsKvWorker(args, config=cfg)
    return ReferenceEngine(MODEL, EngineConfig(tokens_per_block=TPB, chunk_size=8), scheduler, [worker]), scheduler, worker


def traced_kib() -> float:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] / 1024


def test_thousands_of_looked_up_never_scheduled_requests_leave_nothing_behind(tmp_path):
    store = str(tmp_path / "store")
    shared = prompt(33, 1)  # 8 full blocks stored
    engine, scheduler, worker = stack(store)
    engine.generate([shared], 2)
    assert scheduler.tracked == 0 and worker.tracked == 0, "a finished request left state behind"

    rid = 1000
    sizes, memory = [], []
    tracemalloc.start()
    try:
        for _ in range(4):
            for _ in range(500):
                rid += 1
                n, is_async = scheduler.get_num_new_matched_tokens(FakeRequest(rid, shared + [rid % 97]), 0)
                assert n == 32 and is_async
            sizes.append(scheduler.tracked)
            time.sleep(TTL * 1.5)
            scheduler.build_connector_meta(type("Out", (), {"new_requests": [], "cached_requests": []})())
            assert scheduler.tracked == 0
            memory.append(traced_kib())
    finally:
        tracemalloc.stop()
    assert 0 < max(sizes) <= 500  # lookups themselves drop the entries that timed out meanwhile
    # the first round warms caches; after it, memory does not grow with the requests seen
    assert max(memory[1:]) - memory[1] < 64, memory
    worker.close()


def test_a_request_aborted_while_its_async_load_runs_is_held_until_the_load_lands(tmp_path):
    store = str(tmp_path / "store")
    shared = prompt(33, 2)
    engine, scheduler, worker = stack(store)
    engine.generate([shared], 2)
    req = FakeRequest(7, shared)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (32, True)
    pages = [list(range(9))]
    scheduler.update_state_after_alloc_by_layer_group(req, pages)
    meta = scheduler.build_connector_meta(type("Out", (), {"new_requests": [], "cached_requests": []})())
    assert meta.async_loads == {7}
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    for layer in range(MODEL.num_layers):
        worker.wait_for_layer_load(layer, None)
        worker.save_kv_layer(layer, None)
    worker.wait_for_save(None)
    saved, loaded = worker.get_finished([], [7])  # the admitting step's end: nothing posted yet (it did the lookup)
    assert saved == [] and loaded == [] and worker.service.snapshot()["loads_posted"] == 0
    worker.bind_connector_meta(scheduler.build_connector_meta(type("Out", (), {"new_requests": [], "cached_requests": []})()))
    worker.start_load_kv(None)  # the next step's start: the load's first slice is posted
    assert worker.service.snapshot()["loads_posted"] > 0
    # aborted before its load was reported: the pages stay allocated until get_finished says so
    assert scheduler.request_finished_by_layer_group(req, pages) is True
    assert scheduler.tracked == 0
    given, deadline = [7], time.monotonic() + 10
    while True:
        saved, loaded = worker.get_finished(given, [])
        given = []
        if saved:
            break
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert saved == [7] and worker.tracked == 0 or worker.get_finished([], []) == ([], [7])
    worker.get_finished([], [])
    assert worker.tracked == 0
    worker.close()


def test_a_request_aborted_before_its_async_load_started_reads_nothing_and_is_released_at_once(tmp_path):
    store = str(tmp_path / "store")
    shared = prompt(33, 2)
    engine, scheduler, worker = stack(store)
    engine.generate([shared], 2)
    posted = worker.service.snapshot()["loads_posted"]
    req = FakeRequest(8, shared)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (32, True)
    pages = [list(range(9))]
    scheduler.update_state_after_alloc_by_layer_group(req, pages)
    worker.bind_connector_meta(scheduler.build_connector_meta(type("Out", (), {"new_requests": [], "cached_requests": []})()))
    worker.start_load_kv(None)  # the load is planned; its first slice goes out at the next step's start
    assert scheduler.request_finished_by_layer_group(req, pages) is True
    saved, loaded = worker.get_finished([8], [8])
    assert saved == [8] and loaded == [8]
    assert worker.service.snapshot()["loads_posted"] == posted
    assert worker.get_load_failures() == [8]  # nothing of it landed: the engine must not use its pages
    assert worker.tracked == 0
    worker.close()


def test_many_requests_through_the_engine_leave_no_state(tmp_path):
    store = str(tmp_path / "store")
    engine, scheduler, worker = stack(store)
    prompts = [prompt(17 + i % 5, 10 + i % 4) for i in range(24)]  # repeats: later ones load (async)
    engine.generate(prompts[:8], 2)
    results = engine.generate(prompts, 2)
    assert sum(r.prefill_tokens_loaded > 0 for r in results) >= 8
    assert scheduler.counters.async_loads >= 8
    assert scheduler.tracked == 0 and worker.tracked == 0
    assert not engine.connector._save_reports and not engine.connector._load_reports and not engine._failed_loads
    worker.close()


def test_the_vllm_scheduler_drops_requests_looked_up_and_never_scheduled(tmp_path):
    from types import SimpleNamespace as NS

    from gdskv.connectors.vllm.scheduler import SchedulerSide
    from gdskv.service import KvService
    from gdskv.store import GroupSpec, NamespaceSpec

    cfg = GdsKvConfig(store_path=str(tmp_path / "store"))
    spec = NamespaceSpec(model="m", dtype="bfloat16", tokens_per_block=TPB, groups=(GroupSpec(0, 256, (0,)),))
    sched = SchedulerSide(KvService(cfg, spec, transfers=False), unscheduled_ttl_s=TTL)
    empty = NS(scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=None,
               scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[], all_token_ids={}))
    for i in range(2000):
        req = NS(request_id=f"r{i}", all_token_ids=list(range(i % 50, i % 50 + 20)), prompt_token_ids=[1], cache_salt=None)
        sched.matched(req, 0)
        if i % 2:
            sched.allocated(req, ([1, 2, 3, 4, 5],), 0)
    assert sched.tracked == 4000
    time.sleep(TTL * 1.5)
    sched.build_meta(empty)
    assert sched.tracked == 2 * 1000, "only the allocated (scheduled) requests stay"
    for i in range(1, 2000, 2):  # finished or aborted: vLLM calls request_finished
        assert sched.finished(NS(request_id=f"r{i}")) is False
    assert sched.tracked == 0
    sched.service.close()
