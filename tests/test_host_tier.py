"""The host-memory tier (gdskv.hosttier) alone, and in KvService's loads and saves on real store
files: hits after a save and after a load, LRU eviction by bytes, ``host_bytes = 0`` off,
wrong-size and corrupt pages never served, readiness respected, counters (the service's and the
store's), several threads at once, and the reference engine giving identical output from hits."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from cache_helpers import drop_cached
from gdskv.config import ConfigError, GdsKvConfig
from gdskv.hostmem import SlabPool
from gdskv.io import batch as batchio
from gdskv.hosttier import DEFAULT_HOST_BYTES, SAVE_EVICT_SHARE, HostTier, keeps_page_cache_reads, physical_memory, tier_bytes
from gdskv.service import KvService, ServiceSetupError
from gdskv.store import GroupSpec, NamespaceSpec
from gdskv.transfer import LoadStatus, SaveStatus

TPB = 4
PAGE = 256
TOKENS = list(range(200, 233))  # 33 tokens: 8 full blocks


def spec(groups: int = 1) -> NamespaceSpec:
    return NamespaceSpec(model="host-tier-test", dtype="bfloat16", tokens_per_block=TPB,
                         groups=tuple(GroupSpec(g, PAGE, (g,)) for g in range(groups)))


def page(seed: int) -> list[torch.Tensor]:
    """A page as two segments (K and V regions)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE // 2,), dtype=torch.uint8, generator=g) for _ in range(2)]


def empty() -> list[torch.Tensor]:
    return [torch.zeros(PAGE // 2, dtype=torch.uint8) for _ in range(2)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def cfg_at(tmp_path: Path, **over) -> GdsKvConfig:
    return GdsKvConfig(store_path=str(tmp_path / "store"), stats_flush_seconds=60.0, **over)


def save_all(svc: KvService, keys: list[bytes]) -> None:
    futs = [svc.save(0, k, keys[i - 1] if i else None, page(i)) for i, k in enumerate(keys)]
    assert [f.result() for f in futs] == [SaveStatus.PUBLISHED] * len(keys)


def flip(path: Path, at: int) -> None:
    """Flip one bit of a chunk file's byte ``at`` (a payload byte: the chunk is then corrupt)."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def run_threads(target, n: int) -> None:
    threads = [threading.Thread(target=target, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def saved_elsewhere(tmp_path: Path, n: int) -> list[bytes]:
    """Keys of the first ``n`` blocks of ``TOKENS``, saved by another service (no host tier) and
    no longer in the page cache, as after a restart: a load reads them from the disk."""
    writer = KvService(cfg_at(tmp_path, host_bytes=0), spec())
    keys = writer.keys(TOKENS)
    save_all(writer, keys[:n])
    for key in keys[:n]:
        drop_cached(Path(writer.namespace.chunk_path(0, key)))
    writer.close()
    return keys


# --- the data structure ------------------------------------------------------------------------

def b(n: int, fill: int) -> list[torch.Tensor]:
    return [torch.full((n,), fill, dtype=torch.uint8)]


def test_lru_evicts_least_recent_pages_by_bytes():
    tier = HostTier(250, pinned=False)
    assert tier.put("a", b(100, 1)).taken and tier.put("b", b(100, 2)).taken
    with tier.borrow("a", 100) as buf:  # a is now the most recent
        assert int(buf[0]) == 1
    put = tier.put("c", b(100, 3))
    assert (put.taken, put.evicted, put.evicted_bytes) == (True, 1, 100)
    assert "b" not in tier and "a" in tier and "c" in tier and tier.used == 200
    assert not tier.put("a", b(100, 9)).taken  # held already: the same bytes, nothing copied
    with tier.borrow("a", 100) as buf:
        assert int(buf[0]) == 1
    put = tier.put("big", b(200, 4))  # needs both remaining pages' room
    assert (put.taken, put.evicted, len(tier), tier.used) == (True, 2, 1, 200)
    assert not tier.put("huge", b(251, 5)).taken and tier.used == 200  # larger than the budget
    assert tier.borrow("big", 199) is None  # only an entry of exactly the asked size is served
    assert tier.discard("big") and tier.used == 0 and not tier.discard("big")


def test_a_borrowed_buffer_is_never_reused_by_an_eviction():
    tier = HostTier(100, pinned=False)
    tier.put("a", b(100, 1))
    lent = tier.borrow("a", 100)
    tier.put("b", b(100, 2))  # evicts a while it is lent
    assert "a" not in tier and int(lent.buf.min()) == 1 == int(lent.buf.max())
    tier.put("c", b(100, 3))  # evicts b, whose buffer nobody holds: reused for c
    assert int(lent.buf.min()) == 1 == int(lent.buf.max())
    lent.release()
    lent.release()  # idempotent
    with tier.borrow("c", 100) as buf:
        assert int(buf.min()) == 3 == int(buf.max())


def test_a_steps_borrows_and_releases_at_once_behave_as_one_at_a_time():
    tier = HostTier(200, pinned=False)
    tier.put("a", b(100, 1))
    tier.put("b", b(100, 2))
    lent = tier.borrow_many(["a", "b", "b", "x", "a"], [100, 99, 100, 100, None])
    assert [x is not None for x in lent] == [True, False, True, False, False]  # wrong size, unknown, unsized
    assert int(lent[0].buf[0]) == 1 and int(lent[2].buf[0]) == 2
    tier.put("c", b(100, 3))  # "a" was borrowed before "b": "a" is the least recent and goes
    assert "a" not in tier and "b" in tier and int(lent[0].buf.max()) == 1  # lent: never reused meanwhile
    entries = [lent[0]._entry, lent[2]._entry]
    assert [e.readers for e in entries] == [1, 1]
    tier.release_many([x for x in lent if x is not None])
    tier.release_many([lent[0]])  # idempotent, as release()
    assert [e.readers for e in entries] == [0, 0]
    assert all(tier.put(k, b(100, 5)).taken for k in "defgh")  # buffers given back: the slabs serve them all


@pytest.mark.skipif(not batchio.available(), reason="the native batch path is not built here")
@pytest.mark.parametrize("total_mib", [2, 40], ids=["cached-copies", "streamed-copies"])
def test_copy_many_moves_every_byte_at_any_alignment_below_and_above_the_streaming_size(total_mib):
    """``copy_many`` copies with memcpy below ``STREAM_COPIES`` (32 MiB a call) and with
    non-temporal stores above: either way every byte of every copy lands, at destinations and
    sources off any alignment, with lengths that end mid-line, and nothing beside them moves."""
    n = 8
    size = (total_mib << 20) // n + 77
    src = torch.randint(0, 256, (n * size + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(total_mib))
    dst = torch.zeros(n * (size + 64) + 64, dtype=torch.uint8)
    copies = [(dst.data_ptr() + 3 + k * (size + 64), src.data_ptr() + 5 + k * size, size) for k in range(n)]
    batchio.copy_many(copies, threads=2)
    assert int(dst[:3].sum()) == 0
    for k in range(n):
        at = 3 + k * (size + 64)
        assert torch.equal(dst[at:at + size], src[5 + k * size:5 + (k + 1) * size])
        assert int(dst[at + size:at + size + 64].sum()) == 0


def test_the_tier_stays_consistent_under_many_threads():
    tier = HostTier(8 * PAGE, pinned=False)
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(300):
            k = (i * 7 + t) % 24
            if i % 3:
                tier.put(k, b(PAGE, k))
            lent = tier.borrow(k, PAGE)
            if lent is not None:
                with lent as buf:
                    if int(buf.min()) != k or int(buf.max()) != k:
                        errors.append(f"key {k} held bytes {int(buf.min())}..{int(buf.max())}")

    run_threads(worker, 6)
    assert not errors
    assert tier.used == PAGE * len(tier) <= 8 * PAGE


def test_a_reserved_buffer_counts_as_used_until_committed_or_aborted():
    tier = HostTier(300, pinned=False)
    assert tier.put("old", b(100, 9)).taken
    slot = tier.reserve("a", 250)  # makes room now: "old" goes
    assert slot is not None and (slot.evicted, slot.evicted_bytes) == (1, 100) and tier.used == 250
    assert "a" not in tier  # not served before its commit
    slot.buf.fill_(7)
    assert tier.commit(slot).taken and tier.used == 250
    with tier.borrow("a", 250) as buf:
        assert int(buf.sum()) == 7 * 250
    assert tier.reserve("a", 250) is None  # held already
    other = tier.reserve("c", 50)
    tier.abort(other)
    assert tier.used == 250 and "c" not in tier


def test_a_step_reserves_and_settles_its_pages_at_once():
    """``reserve_many``/``settle_many`` (a step's disk loads) keep the accounting of one page at a
    time: a held key, a size that cannot be kept and a page with no size get no buffer; room is
    made by eviction; a commit that lost a race and an abort give their buffers back for reuse."""
    tier = HostTier(400, pinned=False)
    assert tier.put("held", b(100, 3)).taken and tier.put("old", b(100, 4)).taken
    slots = tier.reserve_many(["held", "big", "none", "a", "b", "c"], [100, 500, None, 100, 100, 100])
    assert [s is None for s in slots] == [True, True, True, False, False, False]
    assert tier.used == 400 and "old" not in tier and "held" in tier  # "held" became the most recent
    a, b_, c = slots[3:]
    a.buf.fill_(1)
    b_.buf.fill_(2)
    assert tier.put("b", b(100, 5)).taken  # another thread's copy of "b" landed first ("held" made room)
    puts = tier.settle_many([a, b_], [c])
    assert [p.taken for p in puts] == [True, False, False]  # the commits', then the abort's
    assert sum(p.evicted for p in puts) == 1  # "old", by one of the three reservations
    assert tier.used == 200 and "c" not in tier and "held" not in tier
    with tier.borrow("a", 100) as buf:
        assert int(buf.sum()) == 100
    with tier.borrow("b", 100) as buf:
        assert int(buf[0]) == 5
    again = tier.reserve_many(["d", "e"], [100, 100])  # "c"'s and the losing "b"'s buffers, reused
    assert {s.buf.data_ptr() for s in again} == {b_.buf.data_ptr(), c.buf.data_ptr()}
    assert tier.used == 400
    tier.settle_many([], again)
    assert tier.used == 200


def test_take_many_hands_out_runs_of_held_buffers_each_once_then_allocates_the_rest():
    """``SlabPool.take_many`` takes a slab's unused buffers a run at a time: every buffer it
    gives is of the size asked, lies in its slab and is given to one caller only, in the order
    ``take`` one by one would give them; mixed sizes come from their own slabs; what held slabs
    lack is allocated; given back, each buffer is taken again."""
    pool = SlabPool(capacity=4000, pinned=False)
    pool.slab_bytes = 1000  # ten 100-byte buffers a slab
    one_by_one = [pool.take(100) for _ in range(3)]
    pool.give_many(one_by_one)
    got = pool.take_many([100] * 14 + [300, 100, 300])
    sizes = [buf.numel() for buf, _ in got]
    assert sizes == [100] * 14 + [300, 100, 300]
    addresses = [buf.data_ptr() for buf, _ in got]
    assert len(set(addresses)) == len(addresses)
    for buf, slab in got:
        base = slab.memory.data_ptr()
        assert base <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= base + slab.nbytes
    assert addresses[:3] == [buf.data_ptr() for buf, _ in reversed(one_by_one)]  # as take() pops them
    assert sum(slab.lent for slab in pool._slabs) == len(got)
    pool.give_many(got)
    assert sum(slab.lent for slab in pool._slabs) == 0
    again = pool.take_many([100] * 15 + [300, 300])
    assert sorted(buf.data_ptr() for buf, _ in again) == sorted(addresses)


def test_saves_in_flight_evict_only_within_their_share_of_the_tier():
    """A full tier: saves take buffers by eviction only while saves in flight hold at most
    ``SAVE_EVICT_SHARE`` of the budget (so a large batch of writes cannot empty the tier before a
    page of it is done); loads are not limited; settling gives the share back."""
    tier = HostTier(800, pinned=False)
    for i in range(8):
        assert tier.put(("old", i), b(100, i)).taken
    assert SAVE_EVICT_SHARE * 800 == 200
    slots = tier.reserve_many(["s1", "s2", "s3"], [100, 100, 100], saving=True)
    assert [s is not None for s in slots] == [True, True, False]
    assert len(tier) == 6 and ("old", 0) not in tier and ("old", 2) in tier
    assert [s.evicted for s in slots[:2]] == [1, 1] and all(s.saving for s in slots[:2])
    load = tier.reserve_many(["l"], [100])  # a load is not held to the saves' share
    assert load[0] is not None and not load[0].saving and len(tier) == 5
    slots[0].buf.fill_(7)
    puts = tier.settle_many([slots[0]], [slots[1], load[0]])
    assert [p.taken for p in puts] == [True, False, False] and "s1" in tier
    again = tier.reserve_many(["s3", "s4", "s5"], [100, 100, 100], saving=True)  # the share is free again
    assert [s is not None for s in again] == [True, True, False]
    tier.settle_many([], again[:2])
    assert tier.used == 600 and tier.reserve_many(["s6", "s7"], [100, 100], saving=True)[1] is not None


def test_a_commit_that_lost_a_race_gives_its_buffer_back():
    tier = HostTier(1000, pinned=False)
    slot = tier.reserve("k", 100)
    assert tier.put("k", b(100, 1)).taken  # another thread's copy landed first
    assert not tier.commit(slot).taken and tier.used == 100
    with tier.borrow("k", 100) as buf:
        assert int(buf[0]) == 1


def test_host_bytes_is_validated_naming_the_setting(tmp_path):
    assert GdsKvConfig(host_bytes="64M").host_bytes == 64 << 20 and GdsKvConfig(host_bytes=0).host_bytes == 0
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(ConfigError, match="host_bytes"):
            GdsKvConfig(host_bytes=bad)
    memory = physical_memory()
    assert tier_bytes(None) == (DEFAULT_HOST_BYTES if memory is None else min(DEFAULT_HOST_BYTES, memory // 8))
    if memory is not None:
        with pytest.raises(ServiceSetupError, match="host_bytes"):
            KvService(cfg_at(tmp_path, host_bytes=memory + 1), spec())


# --- in the service, on real store files ---------------------------------------------------------

def test_a_saved_page_is_served_from_host_memory(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:2])
    out = empty()
    assert svc.load(0, keys[1], out).result() is LoadStatus.LOADED and same(out, page(1))
    c, disk = svc.snapshot(), svc.namespace.counters.snapshot()
    assert (c["host_hits"], c["host_hit_bytes"], c["host_fills"], c["loads_loaded"], c["bytes_loaded"]) == (1, PAGE, 2, 1, PAGE)
    assert disk.get("loads_hit", 0) == 0 and disk["host_hits"] == 1  # the disk was not read
    svc.close()


def test_a_steps_hits_are_copied_at_once_and_counted_once_each(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:8])
    outs = [empty() for _ in range(8)]
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(8)])
    assert all(f.done() for f in futures)  # served on the caller's thread, no hand-off
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 8
    assert all(same(outs[i], page(i)) for i in range(8))
    c = svc.snapshot()
    assert (c["host_hits"], c["host_hit_bytes"], c["loads_loaded"], c["bytes_loaded"]) == (8, 8 * PAGE, 8, 8 * PAGE)
    assert svc.namespace.counters["host_hits"] == 8 and svc.namespace.counters["loads_hit"] == 0
    svc.close()


def test_a_page_loaded_from_disk_is_served_from_memory_next_time(tmp_path):
    keys = saved_elsewhere(tmp_path, 1)
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    out = empty()
    assert svc.load(0, keys[0], out).result() is LoadStatus.LOADED and same(out, page(0))
    assert (svc.snapshot()["host_misses"], svc.snapshot()["host_fills"]) == (1, 1)
    out = empty()
    assert svc.load(0, keys[0], out).result() is LoadStatus.LOADED and same(out, page(0))
    c = svc.snapshot()
    assert (c["host_hits"], c["host_misses"]) == (1, 1)
    assert svc.namespace.counters["loads_hit"] == 1  # one disk read for two loads
    svc.close()


def test_a_page_cache_read_into_host_memory_leaves_the_tier_alone(tmp_path):
    """A chunk the page cache holds, loaded into a page in host memory, is not copied into the
    tier (the kernel keeps those bytes in host memory already; ``keeps_page_cache_reads``): the
    page is right, the buffer reserved for it goes back, and what the reservation evicted is
    counted. Once the page cache has dropped it, the next load reads the disk and fills the tier."""
    keys = saved_elsewhere(tmp_path, 3)
    svc = KvService(cfg_at(tmp_path, host_bytes=2 * PAGE), spec())
    for i in (0, 1):  # read from the disk: kept
        assert svc.load(0, keys[i], empty()).result() is LoadStatus.LOADED
    assert len(svc.host) == 2 and svc.snapshot()["host_fills"] == 2
    path = Path(svc.namespace.chunk_path(0, keys[2]))
    path.read_bytes()
    out = empty()
    assert svc.load(0, keys[2], out).result() is LoadStatus.LOADED and same(out, page(2))
    c = svc.snapshot()
    assert (c["host_fills"], c["host_evictions"], len(svc.host), svc.host.used) == (2, 1, 1, PAGE)
    assert (0, 0, keys[2]) not in svc.host
    drop_cached(path)
    assert svc.load(0, keys[2], empty()).result() is LoadStatus.LOADED
    assert (0, 0, keys[2]) in svc.host and svc.snapshot()["host_fills"] == 3
    out = empty()
    assert svc.load(0, keys[2], out).result() is LoadStatus.LOADED and same(out, page(2))
    assert svc.snapshot()["host_hits"] == 1
    svc.close()


def test_only_pages_outside_host_memory_keep_what_the_page_cache_served():
    assert not keeps_page_cache_reads([torch.empty(8, dtype=torch.uint8)])
    assert keeps_page_cache_reads([torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8, device="meta")])


def test_a_cold_load_fills_its_tier_buffer_and_is_counted_once(tmp_path):
    """With the tier on, a page read from disk fills the buffer the tier keeps it in, in the pass
    that fills the page slot: the entry holds exactly the page, it is one fill, and a corrupt
    chunk leaves no entry and no room taken."""
    keys = saved_elsewhere(tmp_path, 4)
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    flip(Path(svc.namespace.chunk_path(0, keys[3])), 5)
    outs = [empty() for _ in range(4)]
    got = [f.result() for f in svc.load_many(0, [(keys[i], outs[i]) for i in range(4)])]
    assert got == [LoadStatus.LOADED] * 3 + [LoadStatus.CORRUPT]
    assert all(same(outs[i], page(i)) for i in range(3))
    c = svc.snapshot()
    assert (c["host_fills"], c["host_fill_bytes"], len(svc.host), svc.host.used) == (3, 3 * PAGE, 3, 3 * PAGE)
    for i in range(3):
        with svc.host.borrow((svc.spec.tp_rank, 0, keys[i]), PAGE) as buf:
            assert torch.equal(buf, torch.cat(page(i)))
    svc.close()


def test_host_bytes_zero_turns_the_tier_off(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes=0), spec())
    assert svc.host is None
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:1])
    for _ in range(2):
        assert svc.load(0, keys[0], empty()).result() is LoadStatus.LOADED
    c = svc.snapshot()
    assert all(v == 0 for k, v in c.items() if k.startswith("host_"))
    assert svc.namespace.counters["loads_hit"] == 2
    svc.close()


def test_the_tier_is_bounded_by_bytes_and_counts_its_evictions(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes=3 * PAGE), spec())
    keys = svc.keys(TOKENS)
    for i in range(5):  # one at a time, so the LRU order is the saves' order; the last three stay
        assert svc.save(0, keys[i], keys[i - 1] if i else None, page(i)).result() is SaveStatus.PUBLISHED
    assert svc.host.used == 3 * PAGE and len(svc.host) == 3
    c = svc.snapshot()
    assert (c["host_fills"], c["host_evictions"], c["host_evicted_bytes"]) == (5, 2, 2 * PAGE)
    out = empty()
    drop_cached(Path(svc.namespace.chunk_path(0, keys[0])))
    assert svc.load(0, keys[0], out).result() is LoadStatus.LOADED and same(out, page(0))  # from disk
    assert svc.load(0, keys[4], empty()).result() is LoadStatus.LOADED  # from memory
    c = svc.snapshot()
    assert (c["host_hits"], c["host_misses"], c["host_evictions"]) == (1, 1, 3)
    svc.flush_stats(force=True)
    [stats_file] = (Path(svc.cfg.store_path) / ".gdskv" / "stats").glob("*.json")
    shared = json.loads(stats_file.read_text())["namespaces"][svc.namespace.id]
    assert (shared["host_hits"], shared["host_misses"], shared["host_hit_bytes"]) == (1, 1, PAGE)
    assert (shared["host_fills"], shared["host_evictions"], shared["host_evicted_bytes"]) == (6, 3, 3 * PAGE)
    svc.close()


def test_a_corrupt_chunk_never_enters_the_tier_and_a_wrong_size_is_never_served(tmp_path):
    keys = saved_elsewhere(tmp_path, 2)
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    flip(Path(svc.namespace.chunk_path(0, keys[0])), 3)
    assert svc.load(0, keys[0], empty()).result() is LoadStatus.CORRUPT
    assert svc.load(0, keys[0], empty()).result() is LoadStatus.MISSING  # quarantined, not in memory
    assert svc.snapshot()["host_fills"] == 0 and len(svc.host) == 0
    # a page of another size is never served from memory, though the tier holds the key
    assert svc.load(0, keys[1], empty()).result() is LoadStatus.LOADED and len(svc.host) == 1
    short = [torch.zeros(PAGE // 2, dtype=torch.uint8), torch.zeros(PAGE // 2 - 8, dtype=torch.uint8)]
    assert svc.load(0, keys[1], short).result() is not LoadStatus.LOADED
    assert svc.snapshot()["host_hits"] == 0
    svc.close()


def test_a_chunk_gone_bad_on_disk_after_it_was_verified_is_served_from_memory_until_restart(tmp_path):
    """Chunks are content-addressed and immutable: the verified copy in memory stays this key's
    KV when another process evicts or quarantines the file. A restart reads the disk again."""
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:1])
    path = Path(svc.namespace.chunk_path(0, keys[0]))
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01
    path.write_bytes(bytes(raw))
    out = empty()
    assert svc.load(0, keys[0], out).result() is LoadStatus.LOADED and same(out, page(0))
    svc.close()
    restarted = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    assert restarted.load(0, keys[0], empty()).result() is LoadStatus.CORRUPT
    restarted.close()


class Gate:
    """A readiness a test releases: what a CUDA event recorded on the engine's stream stands for."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.event.wait(10)


def test_a_hit_writes_the_page_only_after_its_readiness(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:1])
    gate, out = Gate(), empty()
    fut = svc.load(0, keys[0], out, ready=gate)
    assert gate.waited.wait(10)  # waited on a copy thread: the caller was not blocked
    assert not fut.done() and all(int(s.count_nonzero()) == 0 for s in out)
    gate.event.set()
    assert fut.result() is LoadStatus.LOADED and same(out, page(0)) and svc.snapshot()["host_hits"] == 1
    svc.close()


def test_a_steps_hits_behind_a_readiness_wait_for_it_once_and_are_copied_in_one_task(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:4])
    gate, waits = Gate(), []
    gate.synchronize = lambda sync=gate.synchronize: (waits.append(1), sync())[1]
    outs = [empty() for _ in range(4)]
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(4)], ready=gate)
    assert gate.waited.wait(10)
    assert not any(f.done() for f in futures) and all(int(s.count_nonzero()) == 0 for o in outs for s in o)
    gate.event.set()
    assert [f.result(timeout=10) for f in futures] == [LoadStatus.LOADED] * 4
    assert all(same(outs[i], page(i)) for i in range(4)) and waits == [1]
    c = svc.snapshot()
    assert (c["host_hits"], c["loads_loaded"], c["bytes_loaded"], svc.in_flight) == (4, 4, 4 * PAGE, 0)
    assert svc.namespace.counters["host_hits"] == 4
    svc.close()


def test_hits_cancelled_before_a_copy_thread_reached_them_give_their_buffers_back(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:3])
    gates = [Gate() for _ in range(2)]  # both copy threads held
    held = [svc.load_many(0, [(keys[i], empty())], ready=gates[i]) for i in range(2)]
    assert all(g.waited.wait(10) for g in gates)
    out = empty()
    queued = svc.load_many(0, [(keys[2], out)], ready=Gate())
    assert queued[0].cancel()
    for g in gates:
        g.event.set()
    assert [f[0].result(timeout=10) for f in held] == [LoadStatus.LOADED] * 2
    assert all(int(s.count_nonzero()) == 0 for s in out)  # never copied
    c = svc.snapshot()
    assert (c["loads_loaded"], c["loads_failed"], c["host_hits"], svc.in_flight) == (2, 1, 2, 0)
    assert all(e.readers == 0 for e in svc.host._entries.values())
    svc.close()


def test_loads_and_saves_from_many_threads_serve_only_their_own_bytes(tmp_path):
    svc = KvService(cfg_at(tmp_path, host_bytes=5 * PAGE), spec())
    keys = svc.keys(list(range(1000, 1000 + 24 * TPB + 1)))
    save_all(svc, keys[:12])
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(40):
            k = (i * 5 + t) % 24
            if k >= 12:
                st = svc.save(0, keys[k], keys[k - 1], page(k)).result()
                if st not in (SaveStatus.PUBLISHED, SaveStatus.EXISTS):
                    errors.append(f"save {k}: {st}")
                continue
            out = empty()
            st = svc.load(0, keys[k], out).result()
            if st is not LoadStatus.LOADED or not same(out, page(k)):
                errors.append(f"load {k}: {st}")

    run_threads(worker, 4)
    assert not errors
    c = svc.snapshot()
    assert c["host_hits"] > 0 and c["host_evictions"] > 0 and svc.host.used <= 5 * PAGE and svc.in_flight == 0
    svc.close()


def test_the_reference_engine_gives_identical_output_from_host_tier_hits(tmp_path):
    from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
    from gdskv.engine import EngineConfig, ModelConfig, ReferenceEngine

    model = ModelConfig(num_layers=2, seed=3)
    engine_cfg = EngineConfig(tokens_per_block=TPB, chunk_size=8, capture_pages=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.vocab_size, (22,), generator=g).tolist() for _ in range(2)]
    [alone] = [ReferenceEngine(model, engine_cfg).generate(prompts, 4)]
    cfg = cfg_at(tmp_path, host_bytes="4M")
    name = model.fingerprint()
    worker = GdsKvWorker(StandaloneLlmArgs.build(name, TPB), config=cfg)
    engine = ReferenceEngine(model, engine_cfg, GdsKvScheduler(StandaloneLlmArgs.build(name, TPB), config=cfg), [worker])
    first = engine.generate(prompts, 4)  # computes, saves: write-through into the tier
    second = engine.generate(prompts, 4)  # the same worker: its prefix comes from memory
    c, disk = worker.service.snapshot(), worker.service.namespace.counters.snapshot()
    worker.close()
    assert [r.prefill_tokens_loaded for r in second] == [20, 20]
    assert c["host_hits"] == c["loads_loaded"] > 0 and c["host_misses"] == 0 and disk.get("loads_hit", 0) == 0
    for a, b1, b2 in zip(alone, first, second):
        assert a.tokens == b1.tokens == b2.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b2.logits))
        served = {k: v for k, v in a.kv_pages.items() if k[2] < 20 // TPB}  # the restored blocks, bit for bit
        assert served and all(b2.kv_pages[k] == v for k, v in served.items())


class _Gate:
    """A readiness the transfer threads wait on until ``open()`` (the test cancels pages meanwhile)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def synchronize(self) -> None:
        assert self._event.wait(10)

    def open(self) -> None:
        self._event.set()


def test_cancelled_loads_give_their_tier_buffers_back_and_leave_nothing_in_flight(tmp_path):
    """Pages cancelled before a transfer thread reached them are skipped: their reserved tier
    buffers are given back, they count as failed, nothing stays in flight, and the pages that ran
    are kept in the tier with their exact bytes."""
    keys = saved_elsewhere(tmp_path, 8)
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    gate = _Gate()
    outs = [empty() for _ in range(8)]
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(8)], ready=gate)
    assert svc.host.used == 8 * PAGE  # reserved while in flight
    cancelled = [i for i in (1, 4, 6) if futures[i].cancel()]
    gate.open()
    ran = [i for i in range(8) if i not in cancelled]
    assert [futures[i].result() for i in ran] == [LoadStatus.LOADED] * len(ran)
    assert all(same(outs[i], page(i)) for i in ran)
    c = svc.snapshot()
    assert svc.in_flight == 0 and cancelled
    assert (c["loads_loaded"], c["loads_failed"], c["host_fills"]) == (len(ran), len(cancelled), len(ran))
    assert svc.host.used == len(ran) * PAGE and len(svc.host) == len(ran)
    svc.close()


def test_an_asynchronous_loads_hits_are_copied_natively_and_finished_by_the_reaping_thread(tmp_path, monkeypatch):
    """Hits of a background load into host memory: no copy thread per page (``_hit_later`` is
    not used), one future for all of them, resolved with the counters moved and every borrowed
    buffer given back on the thread that reaps; misses of the same load read the disk."""
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:8])
    for i in (2, 5):
        assert svc.host.discard((svc.spec.tp_rank, 0, keys[i]))
    monkeypatch.setattr(svc, "_hits_after", lambda rank, hits, *a: hits and pytest.fail("a hit went to the copy threads"))
    threads: set[int] = set()
    outs = [empty() for _ in range(8)]
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(8)], background=True)
    hits = [futures[i] for i in range(8) if i not in (2, 5)]
    assert len({id(f) for f in hits}) == 1  # one future for the step's hits
    for f in futures:
        f.add_done_callback(lambda _: threads.add(threading.get_ident()))
    deadline = time.monotonic() + 10
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline
        svc.reap()
        time.sleep(0.001)
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 8
    assert all(same(outs[i], page(i)) for i in range(8))
    assert threads == {threading.get_ident()}
    c = svc.snapshot()
    assert (c["host_hits"], c["host_hit_bytes"], c["loads_loaded"], c["bytes_loaded"]) == (6, 6 * PAGE, 8, 8 * PAGE)
    assert svc.namespace.counters["host_hits"] == 6 and svc.namespace.counters["loads_hit"] == 2
    assert svc.in_flight == 0 and all(e.readers == 0 for e in svc.host._entries.values())
    svc.close()


def test_an_asynchronous_loads_hits_without_a_native_path_go_to_the_copy_threads(tmp_path, monkeypatch):
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:4])
    monkeypatch.setattr(svc.transfer, "copy_later", lambda copies, on_done: None)
    outs = [empty() for _ in range(4)]
    threads: set[int] = set()
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(4)], background=True)
    futures[0].add_done_callback(lambda _: threads.add(threading.get_ident()))
    assert len({id(f) for f in futures}) == 1  # one task on a copy thread for the step's hits
    assert [f.result(timeout=10) for f in futures] == [LoadStatus.LOADED] * 4  # nobody reaps
    assert all(same(outs[i], page(i)) for i in range(4))
    c = svc.snapshot()
    assert (c["host_hits"], c["loads_posted"], c["loads_loaded"]) == (4, 4, 4)
    assert svc.in_flight == 0
    svc.close()


def test_an_unreaped_asynchronous_hit_resolves_for_a_caller_blocked_on_it(tmp_path, monkeypatch):
    from gdskv.transfer import later as transfer_later

    monkeypatch.setattr(transfer_later, "REAP_GRACE", 3600.0)
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:2])
    outs = [empty() for _ in range(2)]
    futures = svc.load_many(0, [(keys[i], outs[i]) for i in range(2)], background=True)
    assert [f.result(timeout=30) for f in futures] == [LoadStatus.LOADED] * 2  # nobody reaps
    assert all(same(outs[i], page(i)) for i in range(2)) and svc.in_flight == 0
    svc.close()


def test_copy_device_queues_every_copy_in_order_on_the_stream_and_stops_at_the_first_error():
    """``batchio.copy_device`` with a stand-in for ``cudaMemcpyAsync`` (same signature; copies
    and records what it was asked): every copy in order, whole, ``cudaMemcpyDefault`` and the
    caller's stream; the first error is returned and nothing after it is queued."""
    import ctypes

    from gdskv.io import batch as batchio

    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    asked: list[tuple[int, int, int, int, int]] = []
    fail_at = [-1]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    def memcpy_async(dst, src, n, kind, stream):
        asked.append((dst, src, n, kind, stream))
        if len(asked) - 1 == fail_at[0]:
            return 700
        ctypes.memmove(dst, src, n)
        return 0

    fn = ctypes.cast(memcpy_async, ctypes.c_void_p).value
    src = torch.arange(3 << 20, dtype=torch.int32).view(torch.uint8)[:(5 << 20) + 3]
    dst = [torch.zeros(5 << 20, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8), torch.zeros(7, dtype=torch.uint8)]
    copies = [(dst[0].data_ptr(), src.data_ptr(), 5 << 20), (dst[1].data_ptr(), src.data_ptr() + (5 << 20), 3),
              (dst[2].data_ptr(), src.data_ptr(), 7)]
    assert batchio.copy_device(copies, fn, 0xABC) == 0
    assert [(d, s, n) for d, s, n, _, _ in asked] == copies  # one call per copy, never cut
    assert {(kind, stream) for *_, kind, stream in asked} == {(4, 0xABC)}
    assert torch.equal(torch.cat(dst[:2]), src) and torch.equal(dst[2], src[:7])
    asked.clear()
    fail_at[0] = 1
    for d in dst:
        d.zero_()
    assert batchio.copy_device(copies, fn, 0xABC) == 700
    assert len(asked) == 2 and bool((dst[2] == 0).all())


def test_a_save_fills_its_tier_buffer_in_the_pass_that_seals_it_not_on_the_serving_thread(tmp_path, monkeypatch):
    """Write-through on the native path: a step's saved pages land in the buffers the tier keeps
    them in during the native pass that checksums and writes them, so finishing the step (its
    ``reap``, on the serving loop's thread) copies nothing; a page already stored gives its
    buffer back; each entry is exactly its page, served back as a hit."""
    from gdskv.io import batch as batchio

    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    svc = KvService(cfg_at(tmp_path, host_bytes="1M"), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:1])
    copied: list[bytes] = []
    real = svc._fill
    monkeypatch.setattr(svc, "_fill", lambda key, segments: (copied.append(key[2]), real(key=key, segments=segments))[1])
    futures = svc.save_many(0, [(keys[i], keys[i - 1] if i else None, page(i)) for i in range(6)])
    svc.reap()
    assert [f.result() for f in futures] == [SaveStatus.EXISTS] + [SaveStatus.PUBLISHED] * 5
    assert copied == [], "the serving thread copied saved pages into the tier"
    c = svc.snapshot()
    assert (c["host_fills"], c["host_fill_bytes"], len(svc.host), svc.host.used) == (6, 6 * PAGE, 6, 6 * PAGE)
    for i in range(6):
        out = empty()
        assert svc.load(0, keys[i], out).result() is LoadStatus.LOADED and same(out, page(i))
    assert svc.snapshot()["host_hits"] == 6 and svc.namespace.counters["loads_hit"] == 0
    svc.close()


def test_saves_into_a_full_tier_fill_their_buffers_in_the_writing_pass_within_their_share(tmp_path, monkeypatch):
    """The steady state of a serving process: the tier is full. A step's saves within the saves'
    share of the tier evict for their buffers and are filled in the native pass that writes them;
    only the rest are copied in on the serving thread when done. All are served back as hits."""
    from gdskv.io import batch as batchio

    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    svc = KvService(cfg_at(tmp_path, host_bytes=8 * PAGE), spec())
    keys = svc.keys(list(range(500, 500 + 12 * TPB + 1)))
    save_all(svc, keys[:8])
    assert len(svc.host) == 8 and svc.host.used == 8 * PAGE
    copied: list[bytes] = []
    real = svc._fill
    monkeypatch.setattr(svc, "_fill", lambda key, segments: (copied.append(key[2]), real(key=key, segments=segments))[1])
    futures = svc.save_many(0, [(keys[i], keys[i - 1], page(i)) for i in range(8, 12)])
    svc.reap()
    assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 4
    assert sorted(copied) == sorted(keys[10:12]), "pages within the saves' share were copied on the serving thread"
    assert all((0, 0, k) in svc.host for k in keys[8:12]) and len(svc.host) == 8
    assert svc.snapshot()["host_evictions"] == 4
    for i in range(8, 12):
        out = empty()
        assert svc.load(0, keys[i], out).result() is LoadStatus.LOADED and same(out, page(i))
    assert svc.snapshot()["host_hits"] == 4
    svc.close()


def test_a_save_takes_only_free_tier_room_and_evicts_nothing_while_it_writes(tmp_path):
    """A full tier smaller than a page over the saves' share: a save gets no buffer up front (its
    write must not push entries out while in flight); the page is copied in when the save is
    done, evicting then, and served back."""
    svc = KvService(cfg_at(tmp_path, host_bytes=3 * PAGE), spec())
    keys = svc.keys(TOKENS)
    save_all(svc, keys[:3])
    assert len(svc.host) == 3 and svc.host.used == 3 * PAGE
    slots = svc.host.reserve_many([(0, 0, keys[3]), (0, 0, keys[4])], [PAGE, PAGE], saving=True)
    assert slots == [None, None] and len(svc.host) == 3 and svc.snapshot().get("host_evictions", 0) == 0
    svc.host.discard((0, 0, keys[0]))
    slots = svc.host.reserve_many([(0, 0, keys[3]), (0, 0, keys[4])], [PAGE, PAGE], saving=True)
    assert slots[0] is not None and slots[1] is None and len(svc.host) == 2
    svc.host.abort(slots[0])
    assert svc.save(0, keys[3], keys[2], page(3)).result() is SaveStatus.PUBLISHED  # into the free room
    assert svc.save(0, keys[4], keys[3], page(4)).result() is SaveStatus.PUBLISHED  # full: copied in when done
    # The first three saves finished in any order, so the least recent of keys 1 and 2 is either.
    assert (0, 0, keys[3]) in svc.host and (0, 0, keys[4]) in svc.host and len(svc.host) == 3
    assert svc.snapshot()["host_evictions"] == 1
    for i in (3, 4):
        out = empty()
        assert svc.load(0, keys[i], out).result() is LoadStatus.LOADED and same(out, page(i))
    assert svc.snapshot()["host_hits"] == 2
    svc.close()
