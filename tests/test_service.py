"""gdskv.service.KvService on real store files: bring-up, lookups across groups and TP shards with
leases, loads and saves, lineage, counters, inactive stores, close."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from gdskv.config import ConfigError, GdsKvConfig
from gdskv.service import KvService, ServiceSetupError
from gdskv.store import GroupSpec, NamespaceSpec
from gdskv.transfer import LoadStatus, SaveStatus

TPB = 4
PAGE = 256


def spec(tp_rank: int = 0, tp_size: int = 1, groups: int = 2) -> NamespaceSpec:
    return NamespaceSpec(model="svc-test", dtype="bfloat16", tokens_per_block=TPB,
                         groups=tuple(GroupSpec(g, PAGE, (g,)) for g in range(groups)), tp_rank=tp_rank, tp_size=tp_size)


def page(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE // 2,), dtype=torch.uint8, generator=g) for _ in range(2)]


def save_blocks(svc: KvService, keys: list[bytes], groups=None, blocks=None) -> None:
    futs = []
    for g in groups if groups is not None else svc.group_ids:
        for i in blocks if blocks is not None else range(len(keys)):
            futs.append(svc.save(g, keys[i], keys[i - 1] if i else None, page(1000 * g + i)))
    assert all(f.result() is SaveStatus.PUBLISHED for f in futs)


@pytest.fixture
def cfg(tmp_path: Path) -> GdsKvConfig:
    return GdsKvConfig(store_path=str(tmp_path / "store"), stats_flush_seconds=60.0)


TOKENS = list(range(100, 121))  # 21 tokens: 5 full blocks, at most 5 servable (the last token is left)


def test_bring_up_creates_a_namespace_per_shard(cfg):
    svc = KvService(cfg, spec(tp_rank=1, tp_size=2))
    try:
        assert svc.active and len(svc.namespaces) == 2
        assert [ns.spec.tp_rank for ns in svc.namespaces] == [0, 1]
        assert svc.namespace.spec.tp_rank == 1 and svc.transfer is not None
        assert svc.store.budget is not None and not svc.store.budget.evicts  # it keeps the index
    finally:
        svc.close()
    with_budget = KvService(GdsKvConfig(store_path=cfg.store_path, max_bytes="1M"), spec())
    assert with_budget.store.budget.evicts
    with_budget.close()


def test_other_geometries_names_the_models_namespaces_this_service_cannot_serve_from(cfg):
    first = KvService(cfg, spec(groups=2))
    first.close()
    other_model = KvService(cfg, dataclasses.replace(spec(groups=1), model="another-model"))
    other_model.close()
    svc = KvService(cfg, spec(groups=1))  # the same model, one group fewer: another namespace
    try:
        assert svc.namespace.id != first.namespace.id
        assert svc.other_geometries() == [first.namespace.id]
    finally:
        svc.close()
    again = KvService(cfg, spec(groups=2))
    try:
        assert again.other_geometries() == [svc.namespace.id]
    finally:
        again.close()


def test_lookup_serves_the_prefix_every_group_and_shard_holds(cfg):
    r0, r1 = KvService(cfg, spec(0, 2)), KvService(cfg, spec(1, 2))
    keys = r0.keys(TOKENS, "salt")
    assert len(keys) == 5
    save_blocks(r0, keys)                       # shard 0: every block in both groups
    save_blocks(r1, keys, groups=[0])           # shard 1: group 0 everywhere,
    save_blocks(r1, keys, groups=[1], blocks=[0, 1, 3])  # group 1 misses block 2
    found = r0.lookup(TOKENS, "salt", 0)
    assert (found.first_block, found.end_block, found.num_new_tokens) == (0, 2, 2 * TPB)
    # the device already holds block 0: only block 1 is new
    assert r0.lookup(TOKENS, "salt", TPB).num_new_tokens == TPB
    # a device prefix that ends inside a block is not extended
    assert r0.lookup(TOKENS, "salt", 2).num_new_tokens == 0
    save_blocks(r1, keys, groups=[1], blocks=[2, 4])
    assert r0.lookup(TOKENS, "salt", 0).end_block == 5
    assert r0.lookup(TOKENS[:20], "salt", 0).end_block == 4  # never the last token
    assert r0.lookup(TOKENS, "other salt", 0).num_new_tokens == 0  # salted keys are other keys
    c = r0.snapshot()
    assert c["lookups"] == 6 and c["matched_tokens"] == 2 * TPB + TPB + 5 * TPB + 4 * TPB
    r0.close(), r1.close()


def test_lookup_leases_what_it_serves(cfg):
    svc = KvService(cfg, spec(), lease_seconds=120)
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys, blocks=[0, 1])
    assert svc.lookup(TOKENS, None).end_block == 2
    now = time.time()
    for g in svc.group_ids:
        for k in keys[:2]:
            assert os.stat(svc.namespace.chunk_path(g, k)).st_atime > now + 100
    svc.close()


def test_a_failed_lease_plans_again(cfg, monkeypatch):
    # the window-aware lookup checks, then leases: an eviction in between plans again
    svc = KvService(cfg, spec())
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys)
    ns = svc.namespace
    real = ns.lease_many
    calls = []

    def evicting_lease(group, ks, lease_seconds=0.0, present=False):
        if not calls:  # an evictor removes block 3 of group 1 between the presence check and the lease
            os.unlink(ns.chunk_path(1, keys[3]))
        calls.append(group)
        return real(group, ks, lease_seconds, present)

    monkeypatch.setattr(ns, "lease_many", evicting_lease)
    found = svc.lookup(TOKENS, None, window_aware=True)
    assert found.end_block == 3
    assert svc.snapshot()["lease_replans"] == 1
    svc.close()


def test_a_lookup_checks_and_leases_in_one_pass(cfg, monkeypatch):
    svc = KvService(cfg, spec())
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys)
    ns = svc.namespace
    os.unlink(ns.chunk_path(1, keys[3]))
    asked = []
    monkeypatch.setattr(ns, "contains_many", lambda *a: asked.append(a) or [False])
    before = time.time_ns()
    found = svc.lookup(TOKENS, None)
    assert found.end_block == 3 and not asked and svc.snapshot()["lease_replans"] == 0
    for group in (0, 1):
        for key in keys[:3]:
            assert os.stat(ns.chunk_path(group, key)).st_atime_ns >= before + int(svc.lease_seconds * 1e9) - 10**9
    wrong = ns.chunk_path(0, keys[1])
    os.truncate(wrong, 10)  # a file of the wrong size is no chunk: not served, whatever its times
    assert svc.lookup(TOKENS, None).end_block == 1
    svc.close()


def test_load_round_trip_counts_and_a_corrupt_chunk_fails(cfg):
    # the disk path alone: with a host tier, the page saved here would be served from memory
    # (tests/test_host_tier.py)
    svc = KvService(dataclasses.replace(cfg, host_bytes=0), spec())
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys, blocks=[0, 1])
    out = [torch.zeros(PAGE // 2, dtype=torch.uint8) for _ in range(2)]
    assert svc.load(1, keys[1], out).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(out, page(1000 + 1)))
    path = svc.namespace.chunk_path(0, keys[0])
    raw = bytearray(Path(path).read_bytes())
    raw[10] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    assert svc.load(0, keys[0], out).result() is LoadStatus.CORRUPT
    assert svc.load(0, keys[4], out).result() is LoadStatus.MISSING
    # the second save of a stored block is not written again
    assert svc.save(1, keys[1], keys[0], page(5)).result() is SaveStatus.EXISTS
    c = svc.snapshot()
    assert c["loads_posted"] == 3 and c["loads_loaded"] == 1 and c["loads_failed"] == 2
    assert c["bytes_loaded"] == PAGE and c["bytes_saved"] == 4 * PAGE
    assert c["saves_published"] == 4 and c["saves_existing"] == 1 and svc.in_flight == 0
    assert not svc.namespace.contains(0, keys[0])  # quarantined
    svc.close()


def test_saves_record_their_parent(cfg):
    from gdskv import format as fmt

    svc = KvService(cfg, spec(groups=1))
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys, blocks=[0, 1])
    svc.close()
    trailer = fmt.unpack(Path(svc.namespace.chunk_path(0, keys[1])).read_bytes()[PAGE:])
    assert trailer.parent_key == keys[0]
    # lineage: extending a chain from a parent gives the same keys as hashing it all
    assert svc.keys(TOKENS, None, start=2, parent=keys[1]) == keys[2:]


def test_counters_reach_the_store_stats(cfg):
    svc = KvService(cfg, spec())
    keys = svc.keys(TOKENS)
    save_blocks(svc, keys, blocks=[0])
    svc.lookup(TOKENS, None)
    svc.flush_stats()  # nothing in flight: written at once
    files = list((Path(cfg.store_path) / ".gdskv" / "stats").glob("*.json"))
    assert len(files) == 1
    counters = json.loads(files[0].read_text())["namespaces"][svc.namespace.id]
    assert counters["lookups"] == 1 and counters["saves_published"] == 2
    svc.close()
    svc.close()  # idempotent


def test_lookup_only_service_posts_no_transfers(cfg):
    writer = KvService(cfg, spec())
    keys = writer.keys(TOKENS)
    save_blocks(writer, keys, blocks=[0])
    writer.close()
    svc = KvService(cfg, spec(), transfers=False)
    assert svc.transfer is None and svc.lookup(TOKENS, None).end_block == 1
    assert svc.load(0, keys[0], page(0)) is None and svc.save(0, keys[1], keys[0], page(0)) is None
    svc.close()


def test_an_unusable_store_is_inactive_and_a_foreign_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    svc = KvService(GdsKvConfig(store_path=str(blocker / "store")), spec())
    assert not svc.active and svc.transfer is None
    assert svc.lookup(TOKENS, None).num_new_tokens == 0
    assert svc.load(0, b"k" * 32, page(0)) is None
    svc.close()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.txt").write_text("not a store")
    with pytest.raises(ServiceSetupError, match="store_path"):
        KvService(GdsKvConfig(store_path=str(foreign)), spec())


def test_a_bad_chunk_key_fails_bring_up(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_TEST_SHORT_KEY", "short")
    with pytest.raises(ConfigError, match="auth_key_env"):
        KvService(GdsKvConfig(store_path=str(tmp_path / "s"), auth_key_env="GDSKV_TEST_SHORT_KEY"), spec())
    with pytest.raises(TypeError):
        KvService({"store_path": str(tmp_path / "s")}, spec())  # type: ignore[arg-type]


def test_page_memory_is_registered_with_the_io_engine(cfg, monkeypatch):
    svc = KvService(cfg, spec())
    seen = []
    monkeypatch.setattr(svc.transfer.engine, "register_buffers", lambda ts: seen.extend(ts) or 0)
    pool = [torch.zeros(8, dtype=torch.uint8)]
    assert svc.register_memory(pool) == 0 and seen == pool
    svc.close()
    assert KvService(cfg, spec(), transfers=False).register_memory(pool) == 0


class NiceProbe:
    """A ``ready`` event: the transfer thread that takes a batch calls ``synchronize()`` on it
    first; it records that thread's nice value."""

    def __init__(self) -> None:
        self.nice: list[int] = []

    def synchronize(self) -> None:
        self.nice.append(os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values are per thread on Linux only")
def test_saves_and_background_loads_run_nicer_than_the_caller_and_waited_for_loads_do_not(cfg):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    svc = KvService(dataclasses.replace(cfg, host_bytes=0, background_nice=7), spec(groups=1))
    keys = svc.keys(TOKENS)
    saved, waited, background = NiceProbe(), NiceProbe(), NiceProbe()
    assert svc.save_many(0, [(keys[0], None, page(1)), (keys[1], keys[0], page(2))], ready=saved)[1].result() is SaveStatus.PUBLISHED
    outs = [[torch.zeros(PAGE // 2, dtype=torch.uint8) for _ in range(2)] for _ in range(2)]
    assert svc.load_many(0, [(keys[0], outs[0])], ready=waited)[0].result() is LoadStatus.LOADED
    assert svc.load_many(0, [(keys[1], outs[1])], ready=background, background=True)[0].result() is LoadStatus.LOADED
    assert torch.equal(torch.cat(outs[1]), torch.cat(page(2)))
    want = min(19, base + 7)
    assert saved.nice and set(saved.nice) == {want}
    assert waited.nice == [base]
    assert background.nice == [want]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched
    svc.close()
    off = KvService(dataclasses.replace(cfg, host_bytes=0, background_nice=0), spec(groups=1))
    probe = NiceProbe()
    off.load_many(0, [(keys[1], outs[1])], ready=probe, background=True)[0].result()
    assert probe.nice == [base]
    off.close()


@pytest.mark.parametrize("limits", [{"max_bytes": 0}, {"max_bytes": 100}, {"min_free_bytes": "1000P"}, {"min_free_percent": 99.99999999}])
def test_limits_that_leave_no_room_for_a_page_are_named_at_bring_up(cfg, caplog, limits):
    svc = KvService(dataclasses.replace(cfg, **limits), spec())
    try:
        assert "every save will be dropped" in caplog.text
        assert svc.save(0, b"k" * 32, None, page(1)).result() is SaveStatus.DROPPED
    finally:
        svc.close()


def test_limits_with_room_for_pages_say_nothing(cfg, caplog):
    KvService(dataclasses.replace(cfg, max_bytes="1M", min_free_percent=1.0), spec()).close()
    assert "every save will be dropped" not in caplog.text
