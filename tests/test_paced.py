"""Paced asynchronous loads (``gdskv.service.paced``) and the host tier's slabs (``gdskv.hostmem``).

The pacing policy on its own (which pages are posted when), then end to end in TensorRT-LLM's
flow on the reference engine with a real store: a prefix of many slices restored asynchronously
is bit-identical to a from-scratch run, the serving loop posts a slice at a time, and a corrupt
chunk in a late slice is recomputed with identical output.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from gdskv.connectors.trtllm.inflight import settle_loads
from gdskv.hostmem import SlabPool
from gdskv.keys import chain_keys
from gdskv.service.paced import PACE_SLICE, PacedLoad
from gdskv.transfer import LoadStatus
from gdskv.engine import EngineConfig, ReferenceEngine
from tests.test_async_load import MODEL, TPB, close, prompt, stack


def scratch(prompts: list[list[int]], max_new: int, split: Any, slots: int) -> list:
    return ReferenceEngine(MODEL, EngineConfig(tokens_per_block=TPB, chunk_size=8, num_slots=slots)).generate(
        prompts, max_new, split_prefill_at=split)


class Posts:
    """A post function whose pages finish when the test says so (the policy alone)."""

    def __init__(self, fail_after: int = -1) -> None:
        self.calls: list[list[int]] = []
        self.futures: dict[int, Future] = {}
        self.fail_after = fail_after

    def __call__(self, items: list[tuple[int, Any]]) -> list[Future]:
        if len(self.calls) == self.fail_after:
            raise OSError("no transfer threads left")
        self.calls.append([i for i, _ in items])
        out = [Future() for _ in items]
        self.futures.update({i: f for (i, _), f in zip(items, out)})
        return out

    def finish(self, indices: Any, status: LoadStatus = LoadStatus.LOADED) -> None:
        for i in indices:
            self.futures[i].set_result(status)


def test_a_paced_load_posts_a_slice_at_a_time_and_never_more_than_two_unfinished():
    posts = Posts()
    load = PacedLoad(list(range(100)), posts, slice_pages=10)
    assert posts.calls == [list(range(10))]
    load.pump()  # ten unfinished: nothing more
    assert len(posts.calls) == 1
    posts.finish(range(3))
    load.pump()  # seven unfinished < a slice: the next one
    assert posts.calls[-1] == list(range(10, 20))
    load.pump()  # seventeen unfinished
    assert len(posts.calls) == 2 and not load.done
    posts.finish(range(3, 20))  # the disk ran dry between pumps: the last page posts the next slice
    assert posts.calls[-1] == list(range(20, 30))
    while len(posts.calls) < 10:
        posts.finish([i for i in posts.calls[-1] if not posts.futures[i].done()])
        load.pump()
    posts.finish([i for i in range(100) if not posts.futures[i].done()])
    assert load.done and [f.result() for f in load.futures] == [LoadStatus.LOADED] * 100
    assert sorted(i for c in posts.calls for i in c) == list(range(100))


def test_a_paced_load_started_later_posts_nothing_before_the_pump_it_starts_at():
    posts = Posts()
    load = PacedLoad(list(range(25)), posts, slice_pages=10, start_at=1)
    assert posts.calls == [] and not load.done
    load.pump()
    assert posts.calls == [list(range(10))]
    posts = Posts()
    load = PacedLoad(list(range(25)), posts, slice_pages=10, start_at=3)
    load.pump()
    load.pump()
    assert posts.calls == [] and not load.done
    load.pump()
    assert posts.calls == [list(range(10))]
    load.pump()  # ten unfinished: nothing more
    posts.finish(range(10))  # and from here on as any other
    assert posts.calls[-1] == list(range(10, 20))


def test_a_cancelled_or_failed_paced_load_finishes_with_its_unposted_pages_failed():
    posts = Posts()
    load = PacedLoad(list(range(50)), posts, slice_pages=10)
    load.cancel()
    assert not load.done  # ten pages still in flight
    posts.finish(range(10))
    load.pump()
    assert load.done and len(posts.calls) == 1
    assert settle_loads({7: load}) == [(7, 40, 50)]

    broken = Posts(fail_after=1)
    load = PacedLoad(list(range(30)), broken, slice_pages=10)
    broken.finish(range(10))  # the refill raises: logged, never into this thread
    assert load.done and load.futures[10:] == [None] * 20
    assert settle_loads({8: load}) == [(8, 20, 30)]


def test_a_long_async_restore_is_posted_slice_by_slice_and_bit_identical(tmp_path):
    store = str(tmp_path / "store")
    long_prompt = prompt(TPB * (2 * PACE_SLICE + 9) + 2, 11)  # three slices and a bit
    blocks = len(long_prompt) // TPB
    engine, _, workers = stack(store, num_slots=2 * blocks)
    engine.generate([long_prompt], 2)
    close(workers)

    engine, _, workers = stack(store, num_slots=2 * blocks)
    sizes: list[int] = []
    real = workers[0].service.load_many

    def counted(group: int, items: Any, **kw: Any) -> list:
        sizes.append(len(items))
        return real(group, items, **kw)

    workers[0].service.load_many = counted  # type: ignore[method-assign]
    [restored] = engine.generate([long_prompt], 3)
    close(workers)
    assert restored.prefill_tokens_loaded == blocks * TPB
    assert max(sizes) <= PACE_SLICE and sum(sizes) == blocks and len(sizes) >= 3
    assert workers[0].counters.loads_loaded == blocks
    [split] = scratch([long_prompt], 3, blocks * TPB, 2 * blocks)
    assert torch.equal(torch.stack(restored.logits), torch.stack(split.logits))


def test_a_corrupt_chunk_in_a_late_slice_is_recomputed_with_identical_output(tmp_path):
    store = str(tmp_path / "store")
    long_prompt = prompt(TPB * (2 * PACE_SLICE + 9) + 2, 12)
    blocks = len(long_prompt) // TPB
    engine, _, workers = stack(store, num_slots=2 * blocks)
    engine.generate([long_prompt], 2)
    path = workers[0].namespace.chunk_path(0, chain_keys(long_prompt, TPB)[blocks - 3])
    close(workers)
    raw = bytearray(open(path, "rb").read())
    raw[5] ^= 0x40
    open(path, "wb").write(bytes(raw))
    engine, _, workers = stack(store, num_slots=2 * blocks)
    [result] = engine.generate([long_prompt], 3)
    close(workers)
    assert workers[0].counters.loads_failed == 1 and result.prefill_tokens_loaded == 0
    [split] = scratch([long_prompt], 3, [None], 2 * blocks)
    assert result.tokens == split.tokens
    assert torch.equal(torch.stack(result.logits), torch.stack(split.logits))


def test_slabs_are_reused_and_stay_within_one_slab_of_the_budget():
    pool = SlabPool(capacity=10 * 1000, pinned=False)
    taken = [pool.take(1000) for _ in range(10)]
    assert all(t is not None for t in taken) and pool.nbytes <= pool.limit
    first = pool.nbytes
    for buf, slab in taken:
        pool.give(buf, slab)
    again = [pool.take(1000) for _ in range(10)]
    assert pool.nbytes == first, "a warm pool allocated again"
    assert {t[0].data_ptr() for t in again} == {t[0].data_ptr() for t in taken}
    assert pool.take(1000 * 12) is None  # nothing lends nothing, and another slab would cross the limit
    for buf, slab in again:
        pool.give(buf, slab)
    big = pool.take(3000)  # slabs lending nothing make room for another size
    assert big is not None and big[0].numel() == 3000 and pool.nbytes <= pool.limit


def test_threads_filling_an_empty_pool_at_once_share_the_slab_being_allocated():
    """The first buffers of a tier are taken by several transfer threads at once (a step's saves
    published together). An allocation that takes time, as a page-locked one does, must not make
    the others allocate slabs of their own until the limit refuses the rest."""

    class SlowPool(SlabPool):
        def _allocate(self, size: int) -> torch.Tensor:
            time.sleep(0.05)
            return super()._allocate(size)

    pool = SlowPool(capacity=1 << 20, pinned=False)
    start = threading.Barrier(8)

    def take() -> object:
        start.wait()
        return pool.take(256)

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda _: take(), range(8)))
    assert all(g is not None for g in got)
    assert pool.nbytes == pool.slab_bytes and len({g[0].data_ptr() for g in got}) == 8
