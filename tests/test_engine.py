"""The reference engine: model determinism, paging, and the connector call sequence of the spec.

The central check is the round trip: run 1 saves KV through an in-memory connector, run 2 (a
fresh engine) loads a prefix from it, run 3 computes from scratch with prefill split where run 2's
loaded prefix ended. Run 2 and run 3 must agree bit for bit, in logits and in page bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import FlatMemoryScheduler, FlatMemoryWorker, MemoryConnector, memory_connector
from gdskv.engine import ConnectorError, EngineConfig, GenerationResult, ModelConfig, ReferenceEngine, SchedulerOutput
from gdskv.keys import chain_keys
from gdskv.layout import BAD_PAGE_INDEX

MODEL = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, seed=7)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model_cfg: ModelConfig, engine_cfg: EngineConfig, conn: Optional[MemoryConnector] = None) -> ReferenceEngine:
    if conn is None:
        return ReferenceEngine(model_cfg, engine_cfg)
    return ReferenceEngine(model_cfg, engine_cfg, conn.scheduler, conn.workers)


def assert_same(a: list[GenerationResult], b: list[GenerationResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert len(x.logits) == len(y.logits)
        for lx, ly in zip(x.logits, y.logits):
            assert torch.equal(lx, ly)


def reports(conn: MemoryConnector, request_id: int) -> list[tuple[bool, Any]]:
    """``(is_first_report, RequestData)`` of one request, in step order."""
    out = []
    for call in conn.calls:
        if call[1] == "build_connector_meta":
            so: SchedulerOutput = call[2]
            out += [(True, d) for d in so.new_requests if d.request_id == request_id]
            out += [(False, d) for d in so.cached_requests if d.request_id == request_id]
    return out


def calls_named(conn: MemoryConnector, method: str) -> list[tuple]:
    return [c for c in conn.calls if c[1] == method]


def round_trip(model_cfg: ModelConfig, engine_cfg: EngineConfig, prompts: list[list[int]], max_new: int = 4, **conn_kw: Any):
    """Save (run 1), restore (run 2), and compute from scratch split at run 2's loaded prefix (run 3)."""
    engine_cfg = dataclasses.replace(engine_cfg, capture_pages=True, poison_last_slot=True)
    saver = memory_connector(model_cfg, engine_cfg, **conn_kw)
    first_engine = engine(model_cfg, engine_cfg, saver)
    first = first_engine.generate(prompts, max_new)
    loader = memory_connector(model_cfg, engine_cfg, store=saver.store, **conn_kw)
    restored_engine = engine(model_cfg, engine_cfg, loader)
    restored = restored_engine.generate(prompts, max_new)
    loaded = [r.prefill_tokens_loaded for r in restored]
    scratch = engine(model_cfg, engine_cfg).generate(prompts, max_new, split_prefill_at=loaded)
    for e in (first_engine, restored_engine):
        assert e.poison_intact()
        assert all(e.kv.allocator.num_free(g) == cap for g, cap in enumerate(e.kv.allocator.capacity))
    return first, restored, scratch, loader


SLIDING = dataclasses.replace(MODEL, attention_windows=(8,))
CASES = {
    "full": (MODEL, EngineConfig(tokens_per_block=4, chunk_size=16), {}),
    "full-flat": (MODEL, EngineConfig(tokens_per_block=4, chunk_size=16), dict(flat=True, flat_worker=True)),
    "chunked": (MODEL, EngineConfig(tokens_per_block=4, chunk_size=5), {}),
    "sliding": (SLIDING, EngineConfig(tokens_per_block=4, chunk_size=8), {}),
    "sliding-flat": (SLIDING, EngineConfig(tokens_per_block=4, chunk_size=6), dict(flat=True, flat_worker=True)),
    "vswa": (dataclasses.replace(MODEL, num_layers=3, attention_windows=(4, 8, None)), EngineConfig(tokens_per_block=4, chunk_size=6), {}),
    "tp2": (MODEL, EngineConfig(tokens_per_block=4, chunk_size=7, tp_size=2), {}),
    "tp2-vswa-split": (
        dataclasses.replace(MODEL, num_layers=3, attention_windows=(6, None)),
        EngineConfig(tokens_per_block=4, chunk_size=9, tp_size=2, split_kv_regions=True),
        {},
    ),
    "split-regions": (MODEL, EngineConfig(tokens_per_block=4, chunk_size=16, split_kv_regions=True), {}),
    "bf16": (dataclasses.replace(MODEL, dtype=torch.bfloat16), EngineConfig(tokens_per_block=4, chunk_size=16), {}),
    "fp16-kv": (dataclasses.replace(MODEL, kv_dtype=torch.float16), EngineConfig(tokens_per_block=4, chunk_size=16), {}),
    "async": (
        dataclasses.replace(MODEL, attention_windows=(8, None)),
        EngineConfig(tokens_per_block=4, chunk_size=8),
        dict(async_load=True, async_save=True),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_restored_prefix_is_bit_identical_to_split_prefill(case: str) -> None:
    model_cfg, engine_cfg, conn_kw = CASES[case]
    prompts = [tokens(30, 1), tokens(27, 2)]  # 27: not a multiple of tokens_per_block
    first, restored, scratch, loader = round_trip(model_cfg, engine_cfg, prompts, **conn_kw)
    assert [r.prefill_tokens_loaded for r in restored] == [28, 24]
    assert all(r.prefill_tokens_loaded == 0 for r in first)
    assert_same(restored, scratch)
    assert_same(restored, first)  # shape-stable math: even the unsplit single pass agrees bit for bit
    for r, s in zip(restored, scratch):
        assert r.kv_pages.keys() == s.kv_pages.keys() and r.kv_pages
        fed = len(r.prompt) + len(r.tokens) - 1  # a partial tail block's unwritten rows are stale bytes
        full = [k for k in r.kv_pages if (k[2] + 1) * engine_cfg.tokens_per_block <= fed]
        assert full and all(r.kv_pages[k] == s.kv_pages[k] for k in full)
    assert all(torch.isfinite(lg).all() for r in restored for lg in r.logits)
    # The first report of a restored request counts the loaded prefix as computed, less what was
    # offered for a synchronous load (as TensorRT-LLM reports it).
    for r in restored:
        first_report = next(d for is_new, d in reports(loader, r.request_id) if is_new)
        offered, is_async = loader.scheduler.answers[r.request_id]
        assert first_report.computed_position == r.prefill_tokens_loaded - (0 if is_async else offered)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    tokens_per_block=st.integers(1, 5),
    chunk_size=st.integers(1, 12),
    windows=st.sampled_from([(), (3,), (7,), (5, None), (2, 9, None)]),
    tp_size=st.sampled_from([1, 2]),
    split_kv_regions=st.booleans(),
    prompt_lens=st.lists(st.integers(2, 26), min_size=1, max_size=3),
    max_new=st.integers(1, 3),
)
def test_round_trip_property(tokens_per_block: int, chunk_size: int, windows: tuple, tp_size: int, split_kv_regions: bool,
                             prompt_lens: list[int], max_new: int) -> None:
    model_cfg = dataclasses.replace(MODEL, num_layers=max(2, len(windows)), attention_windows=windows)
    cfg = EngineConfig(tokens_per_block=tokens_per_block, chunk_size=chunk_size, tp_size=tp_size, split_kv_regions=split_kv_regions)
    prompts = [tokens(n, 100 + i) for i, n in enumerate(prompt_lens)]
    first, restored, scratch, _ = round_trip(model_cfg, cfg, prompts, max_new)
    assert [r.prefill_tokens_loaded for r in restored] == [(n - 1) // tokens_per_block * tokens_per_block for n in prompt_lens]
    assert_same(restored, scratch)
    assert_same(restored, first)


def test_chunking_and_batching_do_not_change_a_bit() -> None:
    prompts = [tokens(23, 3), tokens(9, 4), tokens(31, 5)]
    results = [engine(MODEL, EngineConfig(chunk_size=c, max_batch=b)).generate(prompts, 5) for c, b in [(64, 8), (3, 8), (7, 1)]]
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])


def test_weights_are_deterministic_per_seed() -> None:
    prompt = [tokens(12, 6)]
    a = engine(MODEL, EngineConfig()).generate(prompt, 3)
    b = engine(MODEL, EngineConfig()).generate(prompt, 3)
    c = engine(dataclasses.replace(MODEL, seed=8), EngineConfig()).generate(prompt, 3)
    assert_same(a, b)
    assert not torch.equal(a[0].first_logits, c[0].first_logits)


def test_tp2_gives_the_same_logits_as_tp1() -> None:
    prompts = [tokens(19, 9), tokens(26, 10)]
    one = engine(MODEL, EngineConfig(chunk_size=6)).generate(prompts, 4)
    two_engine = engine(MODEL, EngineConfig(chunk_size=6, tp_size=2))
    assert_same(one, two_engine.generate(prompts, 4))
    tp1_page = engine(MODEL, EngineConfig()).layouts[0].groups[0].bytes_per_page
    assert [layout.groups[0].bytes_per_page for layout in two_engine.layouts] == [tp1_page // 2] * 2


def test_call_sequence_follows_the_spec() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8, tp_size=2)
    conn = memory_connector(MODEL, cfg)
    [result] = engine(MODEL, cfg, conn).generate([tokens(13, 11)], 3)
    rid = result.request_id
    assert [c[1] for c in conn.calls[:2]] == ["register_kv_cache_layout"] * 2
    sched = [c[1] for c in conn.calls if c[0] == "scheduler"]
    assert sched[:3] == ["get_num_new_matched_tokens", "update_state_after_alloc_by_layer_group", "build_connector_meta"]
    assert sched.count("get_num_new_matched_tokens") == 1 and sched[-1] == "request_finished_by_layer_group"
    assert calls_named(conn, "get_num_new_matched_tokens")[0][2:] == (rid, 0)

    per_step = []
    for c in conn.calls[2:]:
        if c[1] == "build_connector_meta":
            per_step.append([])
        elif c[0] != "scheduler":
            per_step[-1].append((c[0], c[1]) + tuple(x for x in c[2:3] if isinstance(x, int)))
    expected = [x for w in ("worker0", "worker1") for x in [(w, "bind_connector_meta"), (w, "start_load_kv")]]
    for layer in range(MODEL.num_layers):
        expected += [("worker0", "wait_for_layer_load", layer), ("worker1", "wait_for_layer_load", layer)]
        expected += [("worker0", "save_kv_layer", layer), ("worker1", "save_kv_layer", layer)]
    expected += [("worker0", "wait_for_save"), ("worker1", "wait_for_save"), ("worker0", "get_finished"), ("worker1", "get_finished")]
    assert per_step and all(step == expected for step in per_step)
    # 13 prompt tokens in chunks of 8 = 2 steps, then 2 generation steps.
    assert len(per_step) == 4
    assert all(c[-1] is None for c in conn.calls if c[1] in ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"))


def test_deltas_under_chunked_prefill_and_generation() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=7)
    conn = memory_connector(MODEL, cfg, flat=True)
    prompt = tokens(23, 12)
    [result] = engine(MODEL, cfg, conn).generate([prompt], 6)
    steps = reports(conn, result.request_id)
    assert [is_new for is_new, _ in steps] == [True] + [False] * (len(steps) - 1)
    data = [d for _, d in steps]
    assert [d.computed_position for d in data] == [0, 7, 14, 21, 23, 24, 25, 26, 27]
    assert [d.num_scheduled_tokens for d in data] == [7, 7, 7, 2, 1, 1, 1, 1, 1]
    assert data[0].new_tokens == prompt and all(d.new_tokens == [] for d in data[1:4])
    assert [d.new_tokens for d in data[4:]] == [[t] for t in result.tokens[:-1]]
    assert sum((d.new_tokens for d in data), []) == prompt + result.tokens[:-1]
    # Blocks: the first chunk's two at allocation, one delta per block as it is first needed.
    [alloc] = calls_named(conn, "update_state_after_alloc")
    assert alloc[3] == [data[0].new_block_ids] and len(data[0].new_block_ids) == 2
    assert [len(d.new_block_ids) for d in data] == [2, 2, 2, 0, 0, 1, 0, 0, 0]
    assert all(d.new_block_ids == d.new_block_ids_by_layer_group[0] for d in data)  # one group: flat == group 0
    [finished] = calls_named(conn, "request_finished")
    assert sum((d.new_block_ids for d in data), []) == finished[3][0]
    assert all(d.block_hashes == [] and d.priorities is None for d in data)


def test_sliding_window_reports_reclaimed_pages_as_bad_page_in_place() -> None:
    model_cfg = SLIDING
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8, poison_last_slot=True, num_slots=12)
    conn = memory_connector(model_cfg, cfg)
    e = engine(model_cfg, cfg, conn)
    [result] = e.generate([tokens(30, 13)], 4)
    # 33 positions fed (30 prompt + 3 generated) = 9 block ordinals; the window (8) at position 32
    # still needs ordinals 6..8, the ones before it were reclaimed.
    [finished] = calls_named(conn, "request_finished_by_layer_group")
    ids = finished[3][0]
    assert len(ids) == 9 and ids[:6] == [BAD_PAGE_INDEX] * 6 and all(s >= 0 for s in ids[6:])
    delta_sum = sum((d.new_block_ids_by_layer_group[0] for _, d in reports(conn, result.request_id)), [])
    assert len(delta_sum) == 9 and all(s >= 0 for s in delta_sum)  # reported with a page, never restated
    assert e.poison_intact()
    # Reclaimed slots were reused (12 slots < 9 ordinals + reuse) and nothing read the poisoned slot.
    reference = engine(model_cfg, EngineConfig(tokens_per_block=4, chunk_size=30, num_slots=64)).generate([tokens(30, 13)], 4)
    assert_same([result], reference)


def test_bad_page_index_is_never_a_subscript() -> None:
    e = engine(MODEL, EngineConfig(tokens_per_block=4))
    kv = e.kv.request_kv([[BAD_PAGE_INDEX]])
    k = [torch.zeros(MODEL.num_kv_heads, MODEL.head_dim)]
    with pytest.raises(IndexError):
        kv.write(0, [0], k, k)
    assert torch.isnan(kv.read(0, 4)[0]).all()  # a reclaimed block reads as NaN, not as the last slot


def test_vswa_layout_and_per_group_lists() -> None:
    model_cfg = dataclasses.replace(MODEL, num_layers=4, attention_windows=(4, None, 8, None))
    cfg = EngineConfig(tokens_per_block=4, chunk_size=6, split_kv_regions=True)
    conn = memory_connector(model_cfg, cfg)
    e = engine(model_cfg, cfg, conn)
    [layout] = e.layouts
    assert [(g.layer_group_id, g.window_size, g.layer_ids, len(g.regions)) for g in layout.groups] == [
        (0, 4, (0,), 2), (1, None, (1, 3), 2), (2, 8, (2,), 2)]
    assert layout.as_single_pool_tensor() is None
    assert [b.role for b in layout.groups[1].regions[1].buffers] == ["value", "value"]
    [result] = e.generate([tokens(21, 14)], 3)
    data = [d for _, d in reports(conn, result.request_id)]
    assert all(d.new_block_ids == [] and len(d.new_block_ids_by_layer_group) == 3 for d in data)
    [finished] = calls_named(conn, "request_finished_by_layer_group")
    window4, full, window8 = finished[3]
    assert len(window4) == len(full) == len(window8) == 6
    assert all(s >= 0 for s in full) and window4.count(BAD_PAGE_INDEX) > window8.count(BAD_PAGE_INDEX) > 0


def test_two_requests_sharing_a_prefix_in_one_batch() -> None:
    shared = tokens(16, 15)
    prompts = [shared + tokens(14, 16), shared + tokens(9, 17)]
    first, restored, scratch, loader = round_trip(MODEL, EngineConfig(tokens_per_block=4, chunk_size=8), prompts)
    assert [r.prefill_tokens_loaded for r in restored] == [28, 24]
    assert_same(restored, scratch)
    # Both requests were in the same steps of run 2.
    first_reports = [c[2] for c in calls_named(loader, "build_connector_meta")][0]
    assert len(first_reports.new_requests) == 2
    # A third prompt sharing only the 16-token prefix loads exactly that.
    third = [shared + tokens(11, 18)]
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8)
    [hit] = engine(MODEL, cfg, memory_connector(MODEL, cfg, store=loader.store)).generate(third, 3)
    assert hit.prefill_tokens_loaded == 16
    assert_same([hit], engine(MODEL, cfg).generate(third, 3, split_prefill_at=16))


def test_salted_requests_do_not_share_kv() -> None:
    cfg = EngineConfig(tokens_per_block=4)
    saver = memory_connector(MODEL, cfg)
    prompt = tokens(20, 19)
    engine(MODEL, cfg, saver).generate([prompt], 2, cache_salts=["alice"])
    loader = memory_connector(MODEL, cfg, store=saver.store)
    bob, alice = engine(MODEL, cfg, loader).generate([prompt, prompt], 2, cache_salts=["bob", "alice"])
    assert (bob.prefill_tokens_loaded, alice.prefill_tokens_loaded) == (0, 16)


@pytest.mark.parametrize(
    "prompt_len, offer, offered, honoured",
    [(30, lambda found, n: found + 3, 31, 28), (32, lambda found, n: n, 32, 28), (3, lambda found, n: n, 3, 0)],
)
def test_engine_honours_full_blocks_and_leaves_one_token_to_compute(prompt_len: int, offer: Any, offered: int, honoured: int) -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8)
    prompt = tokens(prompt_len, 20)
    saver = memory_connector(MODEL, cfg)
    engine(MODEL, cfg, saver).generate([prompt], 3)
    loader = memory_connector(MODEL, cfg, store=saver.store, offer=offer)
    [result] = engine(MODEL, cfg, loader).generate([prompt], 3)
    assert result.prefill_tokens_loaded == honoured
    first = reports(loader, result.request_id)[0][1]
    # the first report leaves out what was offered (as TensorRT-LLM does), so it may be negative
    assert first.computed_position == honoured - offered and first.num_scheduled_tokens == min(8, prompt_len - honoured)
    assert_same([result], engine(MODEL, cfg).generate([prompt], 3))


def test_async_load_waits_outside_the_forward_pass_and_async_save_holds_pages() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8)
    prompt = tokens(22, 21)
    saver = memory_connector(MODEL, cfg, async_save=True)
    e = engine(MODEL, cfg, saver)
    free_at_poll: list[tuple[list[int], int]] = []
    poll = saver.workers[0].get_finished

    def spy(finished_gen: list[int], started_loading: list[int]) -> tuple[list[int], list[int]]:
        free_at_poll.append((list(finished_gen), e.kv.allocator.num_free(0)))
        return poll(finished_gen, started_loading)

    saver.workers[0].get_finished = spy  # type: ignore[method-assign]
    [saved] = e.generate([prompt], 3)
    capacity = e.kv.allocator.capacity[0]
    # The request finished (and was reported) while its 6 pages were still held; they came back after.
    finished_step = next(i for i, (fin, _) in enumerate(free_at_poll) if fin == [saved.request_id])
    assert free_at_poll[finished_step][1] == capacity - 6
    assert finished_step == len(free_at_poll) - 2 and e.kv.allocator.num_free(0) == capacity

    loader = memory_connector(MODEL, cfg, store=saver.store, async_load=True)
    [restored] = engine(MODEL, cfg, loader).generate([prompt], 3)
    steps = reports(loader, restored.request_id)
    assert steps[0][0] and steps[0][1].num_scheduled_tokens == 0 and steps[0][1].computed_position == 20
    polls = calls_named(loader, "get_finished")
    assert polls[0][3] == [restored.request_id]  # started_loading_req_ids in the admitting step
    assert not steps[1][0] and steps[1][1].computed_position == 20 and steps[1][1].num_scheduled_tokens == 2
    assert steps[1][1].new_block_ids == []
    # The worker answers "loaded" one poll late (at the end of step 1): the request sits step 1 out.
    metas = [c[2] for c in calls_named(loader, "build_connector_meta")]
    ran = [i for i, so in enumerate(metas) if any(d.request_id == restored.request_id for d in so.new_requests + so.cached_requests)]
    assert ran == [0, 2, 3, 4]
    assert_same([restored], [saved])


def test_async_completion_counts_once_every_tp_rank_reports_it() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8, tp_size=2)
    prompt = tokens(22, 29)
    saver = memory_connector(MODEL, cfg)
    engine(MODEL, cfg, saver).generate([prompt], 2)
    loader = memory_connector(MODEL, cfg, store=saver.store, async_load=True, async_save=True)
    loader.workers[0].report_delay, loader.workers[1].report_delay = 0, 3
    [result] = engine(MODEL, cfg, loader).generate([prompt], 2)
    metas = [c[2] for c in calls_named(loader, "build_connector_meta")]
    ran = [i for i, so in enumerate(metas) if any(d.request_id == result.request_id for d in so.new_requests + so.cached_requests)]
    # Admitted at step 0; rank 0 reports the load at once, rank 1 three polls later: it runs at step 3+1.
    assert ran == [0, 4, 5]
    # Finished at step 5; rank 1 reports the save three polls later, and only then does generate return.
    assert len(metas) == 5 + 3 + 1
    assert result.prefill_tokens_loaded == 20


def test_failed_load_is_recomputed_not_used() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8)
    prompt = tokens(26, 22)
    saver = memory_connector(MODEL, cfg)
    [clean] = engine(MODEL, cfg, saver).generate([prompt], 3)
    saver.store.corrupt.add(chain_keys(prompt, 4)[2])
    loader = memory_connector(MODEL, cfg, store=saver.store, report_failures=True)
    [result] = engine(MODEL, cfg, loader).generate([prompt], 3)
    assert result.prefill_tokens_loaded == 0
    assert_same([result], [clean])
    failures = [c[2] for c in calls_named(loader, "get_load_failures")]
    assert failures[0] == [result.request_id] and all(f == [] for f in failures[1:])
    positions = [d.computed_position for _, d in reports(loader, result.request_id)]
    # the first report leaves out the 24 tokens offered (TensorRT-LLM's way); the loaded prefix
    # was then discarded and recomputed
    assert positions[:3] == [0, 0, 8]


def test_flat_connector_on_a_uniform_sliding_window_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    model_cfg = dataclasses.replace(MODEL, attention_windows=(8,))
    cfg = EngineConfig(tokens_per_block=4)
    with caplog.at_level("WARNING", logger="gdskv.engine.driver"):
        engine(model_cfg, cfg, memory_connector(model_cfg, cfg, flat=True))
    assert "sliding window 8" in caplog.text


def test_single_full_pool_reaches_register_kv_caches() -> None:
    cfg = EngineConfig(tokens_per_block=4, num_slots=10)
    conn = memory_connector(MODEL, cfg, flat=True, flat_worker=True)
    e = engine(MODEL, cfg, conn)
    assert conn.calls[0] == ("worker0", "register_kv_caches", (10, MODEL.num_layers, 2, 4 * MODEL.num_kv_heads * MODEL.head_dim))
    assert e.layouts[0].as_single_pool_tensor().shape == (10, 2, 2, 64)


class _Mixed:
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        return None

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        pass

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return False


class _ZeroAsync(_Mixed):
    def request_finished_by_layer_group(self, request: Any, ids: list[list[int]]) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, True


def test_bring_up_refuses_what_the_spec_refuses() -> None:
    cfg = EngineConfig(tokens_per_block=4)
    workers = memory_connector(MODEL, cfg).workers
    with pytest.raises(ConnectorError, match="lacks request_finished_by_layer_group"):
        ReferenceEngine(MODEL, cfg, _Mixed(), workers)
    vswa = dataclasses.replace(MODEL, attention_windows=(4, None))
    flat = memory_connector(vswa, cfg, flat=True)
    with pytest.raises(ConnectorError, match="2 layer groups.*update_state_after_alloc_by_layer_group"):
        engine(vswa, cfg, flat)
    flat_worker = memory_connector(vswa, cfg, flat_worker=True)
    with pytest.raises(ConnectorError, match=r"2 layer groups with \[1, 1\] regions"):
        engine(vswa, cfg, flat_worker)
    split = dataclasses.replace(cfg, split_kv_regions=True)
    with pytest.raises(ConnectorError, match=r"1 layer groups with \[2\] regions"):
        engine(MODEL, split, memory_connector(MODEL, split, flat_worker=True))
    with pytest.raises(ConnectorError, match="one worker per rank"):
        ReferenceEngine(MODEL, dataclasses.replace(cfg, tp_size=2), memory_connector(MODEL, cfg).scheduler, workers)
    zero_async = ReferenceEngine(MODEL, cfg, _ZeroAsync(), workers)
    with pytest.raises(ConnectorError, match=r"\(0, True\)"):
        zero_async.generate([tokens(9, 23)], 1)


class KvCacheConnectorScheduler:
    """Mimics the spec's base class: every callback defined, the per-layer-group ones as defaults."""

    def update_state_after_alloc_by_layer_group(self, request: Any, ids: list[list[int]]) -> None:
        self.update_state_after_alloc(request, ids[0])  # type: ignore[attr-defined]

    def request_finished_by_layer_group(self, request: Any, ids: list[list[int]]) -> bool:
        return self.request_finished(request, ids[0])  # type: ignore[attr-defined]


class KvCacheConnectorWorker:
    """Mimics the spec's base class: a default ``register_kv_cache_layout``."""

    def register_kv_cache_layout(self, layout: Any) -> None:
        raise AssertionError("the engine must not call an inherited default it can replace")


def test_inherited_base_class_defaults_do_not_count_as_implemented() -> None:
    class FlatSubclass(FlatMemoryScheduler, KvCacheConnectorScheduler):
        pass

    class FlatWorkerSubclass(FlatMemoryWorker, KvCacheConnectorWorker):
        pass

    cfg = EngineConfig(tokens_per_block=4)
    conn = memory_connector(MODEL, cfg)
    scheduler = FlatSubclass(conn.store, 4, conn.calls, False, False)
    worker = FlatWorkerSubclass(0, conn.store, conn.calls, 4, False)
    e = ReferenceEngine(MODEL, cfg, scheduler, [worker])
    assert conn.calls[0][1] == "register_kv_caches"
    e.generate([tokens(10, 28)], 2)
    assert [c[1] for c in conn.calls if c[1].startswith(("update_state", "request_finished"))] == [
        "update_state_after_alloc", "request_finished"]
    vswa = dataclasses.replace(MODEL, attention_windows=(4, None))
    with pytest.raises(ConnectorError, match="implements only the flat callbacks"):
        ReferenceEngine(vswa, cfg, scheduler, [worker])


def test_requests_queue_when_pages_run_short() -> None:
    cfg = EngineConfig(tokens_per_block=4, chunk_size=8, num_slots=9)
    conn = memory_connector(MODEL, cfg)
    prompts = [tokens(25, 24), tokens(30, 25), tokens(18, 26)]
    results = engine(MODEL, cfg, conn).generate(prompts, 3)
    firsts = [c[2] for c in calls_named(conn, "build_connector_meta") if c[2].new_requests]
    assert [[d.request_id for d in so.new_requests] for so in firsts] == [[r.request_id] for r in results]
    assert_same(results, engine(MODEL, EngineConfig(num_slots=64)).generate(prompts, 3))
    with pytest.raises(ValueError, match="num_slots"):
        engine(MODEL, cfg).generate([tokens(40, 27)], 2)


def test_layout_rows_are_page_slots() -> None:
    cfg = EngineConfig(tokens_per_block=4, num_slots=6)
    e = engine(MODEL, cfg)
    pool = e.layouts[0].as_single_pool_tensor()
    region = e.layouts[0].groups[0].regions[0]
    pool[3].fill_(1.5)
    assert torch.equal(region.slot_tensor(3, torch.float32), torch.full((pool[0].numel(),), 1.5))
    assert e.kv.page_bytes(0, 0, 3) == pool[3].numpy().tobytes()


STEADY_HEAP_PROBE = """
import ctypes, os, platform, sys
import torch
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
from gdskv.engine.heap import keep_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

steady = sys.argv[1] == "steady"
model = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    intermediate_size=64, seed=7)
prompts = [torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
# the first large block of a fresh process: glibc maps it and unmaps it at free, unless the heap is kept
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
if steady:
    assert keep_freed_memory()
n = 16 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
held = rss()
libc.free(p)
print(held - rss())
engine = ReferenceEngine(model, EngineConfig(tokens_per_block=4, num_slots=64, steady_heap=steady))
print([r.tokens for r in engine.generate(prompts, [6, 6])])
"""


def test_a_steady_heap_keeps_freed_memory_and_changes_no_token(tmp_path) -> None:
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the steady heap is glibc's mallopt")
    script = tmp_path / "probe.py"
    script.write_text(STEADY_HEAP_PROBE)
    out = {}
    for kind in ("default", "steady"):
        done = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        returned, generated = done.stdout.splitlines()
        out[kind] = (int(returned), generated)
    assert out["default"][0] >= 12 << 20  # given back to the kernel at free
    assert out["steady"][0] < 4 << 20  # kept for the next step
    assert out["steady"][1] == out["default"][1]
