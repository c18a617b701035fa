"""Asynchronous loads in TensorRT-LLM's flow: gdskv's connector on the reference engine, real store.

With ``async_load_min_bytes`` at or below a load's size, ``get_num_new_matched_tokens`` answers
``is_async=True``: the load is planned at ``update_state_after_alloc``, posted by the workers
without being awaited in the forward pass, reported through ``get_finished``; the request joins
the batch afterwards. Checked here: the restored request's logits are bit-identical to a
from-scratch run split at the restored token; other requests keep decoding while the load is in
flight; a corrupt chunk fails the load, the engine recomputes, the output is identical and the
chunk is stored again; the threshold decides sync vs async.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import pytest
import torch

from gdskv.config import GdsKvConfig
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine
from gdskv.keys import chain_keys

TPB = 4
MODEL = ModelConfig(num_layers=3, seed=5)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LONG = prompt(39, 1)  # 9 full blocks + 3 tokens: 36 tokens servable
SHORT = prompt(6, 2)


def stack(store: str, tp: int = 1, threshold: Optional[int] = 0, **engine: Any) -> tuple[ReferenceEngine, GdsKvScheduler, list[GdsKvWorker]]:
    cfg = GdsKvConfig(store_path=store, async_load_min_bytes=threshold)
    name = MODEL.fingerprint()
    scheduler = GdsKvScheduler(StandaloneLlmArgs.build(name, TPB, 0, tp), config=cfg)
    workers = [GdsKvWorker(StandaloneLlmArgs.build(name, TPB, r, tp), config=cfg) for r in range(tp)]
    ecfg = EngineConfig(tokens_per_block=TPB, chunk_size=8, tp_size=tp, poison_last_slot=True, **engine)
    return ReferenceEngine(MODEL, ecfg, scheduler, workers), scheduler, workers


def close(workers: list[GdsKvWorker]) -> None:
    for w in workers:
        w.close()


def scratch(prompts: list[list[int]], max_new: int, split: Any = None, tp: int = 1) -> list:
    ecfg = EngineConfig(tokens_per_block=TPB, chunk_size=8, tp_size=tp)
    return ReferenceEngine(MODEL, ecfg).generate(prompts, max_new, split_prefill_at=split)


def save_long(store: str, tp: int = 1) -> None:
    engine, _, workers = stack(store, tp)
    engine.generate([LONG], 2)
    close(workers)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_async_restore_is_bit_identical_to_a_split_from_scratch_run(tmp_path, tp):
    store = str(tmp_path / "store")
    save_long(store, tp)
    engine, scheduler, workers = stack(store, tp)
    [restored] = engine.generate([LONG], 4)
    close(workers)
    assert restored.prefill_tokens_loaded == 36
    assert scheduler.counters.async_loads == 1 and scheduler.counters.loads_planned == 9
    assert all(w.counters.loads_loaded == 9 and w.counters.loads_failed == 0 for w in workers)
    [split] = scratch([LONG], 4, split=36, tp=tp)
    assert torch.equal(torch.stack(restored.logits), torch.stack(split.logits))
    assert restored.tokens == split.tokens
    assert engine.poison_intact()
    loading_steps = [s for s in engine.step_log if s.loading]
    assert loading_steps and all(restored.request_id not in s.prefilling + s.decoding for s in loading_steps)


def test_other_requests_keep_decoding_while_a_prefix_loads(tmp_path):
    store = str(tmp_path / "store")
    save_long(store)
    engine, _, workers = stack(store)
    gate = threading.Event()
    load_many = workers[0].service.load_many

    def held_loads(*args: Any, **kwargs: Any) -> list[Future]:
        """The real loads, whose completion is reported only once ``gate`` opens."""
        real = load_many(*args, **kwargs)
        out: list[Future] = [Future() for _ in real]

        def relay() -> None:
            gate.wait(30)
            for fut, done in zip(out, real):
                fut.set_result(done.result())

        threading.Thread(target=relay, daemon=True).start()
        return out

    workers[0].service.load_many = held_loads  # type: ignore[method-assign]

    def open_gate_after_steps() -> None:
        while len(engine.step_log) < 12:
            threading.Event().wait(0.001)
        gate.set()

    opener = threading.Thread(target=open_gate_after_steps, daemon=True)
    opener.start()
    short, restored = engine.generate([SHORT, LONG], [120, 16], arrival_steps=[0, 3])
    close(workers)
    loading = [s for s in engine.step_log if restored.request_id in s.loading]
    assert len(loading) >= 8, "the loading request was not held out of the batch while its load was in flight"
    assert all(short.request_id in s.decoding for s in loading), "the decoding request stalled while a prefix loaded"
    assert restored.prefill_tokens_loaded == 36
    ref_short, ref_long = scratch([SHORT, LONG], [120, 16], split=[None, 36])
    assert short.tokens == ref_short.tokens and restored.tokens == ref_long.tokens
    assert torch.equal(torch.stack(restored.logits), torch.stack(ref_long.logits))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_corrupt_chunk_in_an_async_load_is_recomputed_with_identical_output(tmp_path, tp):
    store = str(tmp_path / "store")
    save_long(store, tp)
    key = chain_keys(LONG, TPB)[4]
    engine, scheduler, workers = stack(store, tp)
    ns = workers[-1].namespace
    path = ns.chunk_path(0, key)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    [result] = engine.generate([LONG], 4)
    close(workers)
    assert scheduler.counters.async_loads == 1
    assert workers[-1].counters.loads_failed == 1
    assert result.prefill_tokens_loaded == 0, "the failed load's prefix was used"
    [clean] = scratch([LONG], 4)
    assert result.tokens == clean.tokens
    torch.testing.assert_close(torch.stack(result.logits), torch.stack(clean.logits), rtol=1e-4, atol=1e-4)
    [split] = scratch([LONG], 4, split=[None])
    assert torch.equal(torch.stack(result.logits), torch.stack(split.logits))
    assert engine.poison_intact()
    assert ns.contains(0, key), "the recomputed block was stored again"
    # and served from the store once more, intact
    engine2, _, workers2 = stack(store, tp)
    [again] = engine2.generate([LONG], 4)
    close(workers2)
    assert again.prefill_tokens_loaded == 36 and again.tokens == clean.tokens


def test_the_threshold_decides_between_sync_and_async(tmp_path):
    store = str(tmp_path / "store")
    save_long(store)
    engine, scheduler, workers = stack(store, threshold=None)
    [sync] = engine.generate([LONG], 2)
    bytes_per_block = workers[0].service.bytes_per_page(0)
    close(workers)
    assert scheduler.counters.async_loads == 0 and sync.prefill_tokens_loaded == 36
    assert not any(s.loading for s in engine.step_log)
    for threshold, expect in ((9 * bytes_per_block, 1), (9 * bytes_per_block + 1, 0)):
        engine, scheduler, workers = stack(store, threshold=threshold)
        [r] = engine.generate([LONG], 2)
        close(workers)
        assert scheduler.counters.async_loads == expect, threshold
        assert r.tokens == sync.tokens and torch.equal(torch.stack(r.logits), torch.stack(sync.logits))


def test_a_bad_threshold_fails_at_bring_up_naming_the_setting(tmp_path):
    from gdskv.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="async_load_min_bytes"):
        GdsKvConfig(store_path=str(tmp_path), async_load_min_bytes=-1)
    with pytest.raises(ConfigError, match="async_load_min_bytes"):
        load_config(store_path=str(tmp_path), async_load_min_bytes="lots")
    assert load_config(store_path=str(tmp_path), async_load_min_bytes="4M").async_load_min_bytes == 4 << 20
    assert load_config(store_path=str(tmp_path), async_load_min_bytes=False).async_load_min_bytes is None
    assert load_config(store_path=str(tmp_path)).async_load_min_bytes == 16 << 20


# --- MAX: load posts the reads and returns; none of them runs on the caller's thread ---------------

def test_max_load_returns_while_every_read_is_still_blocked(tmp_path):
    from gdskv.connectors.max import GdsKvConnector, LeafMemory
    from gdskv.connectors.max.types import KVCacheGroupId
    from gdskv.io.posix import PosixEngine

    class HeldReads(PosixEngine):
        """Reads wait for ``gate``; records which threads read."""

        def __init__(self) -> None:
            super().__init__(threads=2)
            self.gate = threading.Event()
            self.readers: set[int] = set()

        def read_now(self, path, segments):  # type: ignore[override]
            self.readers.add(threading.get_ident())
            assert self.gate.wait(30), "the test never opened the gate"
            return super().read_now(path, segments)

        def read_chunks_now(self, root_fd, jobs, threads=1):  # type: ignore[override]
            self.readers.add(threading.get_ident())
            assert self.gate.wait(30), "the test never opened the gate"
            return super().read_chunks_now(root_fd, jobs, threads)

    leaves = {"full": KVCacheGroupId.full()}
    pages = torch.randint(0, 256, (8, 512), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    engine = HeldReads()
    conn = GdsKvConnector(leaves, [{"full": LeafMemory((pages,), False)}], model="tiny", dtype="float32", tokens_per_block=16,
                          config=GdsKvConfig(store_path=str(tmp_path / "store"), host_bytes=0),  # reads from disk
                          engine=engine)
    try:
        hashes = [i.to_bytes(8, "big") for i in range(3)]
        saved = conn.offload({"full": [0, 1, 2]}, {"full": hashes})
        saved.synchronize()
        before = pages[:3].clone()
        conn.lookup(hashes)
        t0 = time.monotonic()
        transfer = conn.load({"full": [4, 5, 6]}, {"full": hashes})
        returned_after = time.monotonic() - t0
        assert not transfer.is_complete(), "load waited for its reads"
        engine.gate.set()
        deadline = time.monotonic() + 10
        while not transfer.is_complete():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert torch.equal(pages[4:7], before)
        assert threading.get_ident() not in engine.readers
        assert returned_after < 5
    finally:
        engine.gate.set()
        conn.shutdown()
