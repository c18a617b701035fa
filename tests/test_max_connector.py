"""The MAX KVConnector protocol, sentence by sentence, without MAX: real store files under tmp_path.

Each test names the contract sentence (``../shared/spec/max-kvconnector.md``) it checks. The
connector is driven the way MAX's cache manager drives it: lookup → load / offload → poll.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from gdskv import format as fmt
from gdskv.config import ConfigError, GdsKvConfig
from gdskv.connectors import max as gmax
from gdskv.connectors.max import lookups as max_lookups
from gdskv.connectors.max import GdsKvConnector, GdsKvLookup, LeafMemory, model_from_argv, model_identity
from gdskv.connectors.max.types import (
    MAX_AVAILABLE,
    ByteCount,
    CompletedTransfer,
    KVCacheGroupId,
    KVLoadFailed,
    KVLoadRefused,
)
from gdskv.io.posix import PosixEngine

FULL = KVCacheGroupId.full()
WINDOW = KVCacheGroupId(type="sliding_window", window_size=64)
PAGES = 16
BPP = 512  # bytes per page


def h8(i: int) -> bytes:
    """An ahash64-style canonical hash: 8 big-endian bytes."""
    return i.to_bytes(8, "big")


def h32(i: int) -> bytes:
    """A SHA-256-style canonical hash: 32 bytes."""
    return hashlib.sha256(b"block %d" % i).digest()


_seeds = itertools.count()


def random_pages(seed: int, pages: int = PAGES, bpp: int = BPP) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, bpp), dtype=torch.uint8, generator=g)


class Rig:
    """One connector over fresh page tensors: ``mem[replica][leaf].shards[shard][block]``."""

    def __init__(self, store: str, leaves: dict | None = None, tp: int = 1, replicas: int = 1,
                 replicated: bool = False, model: str = "tiny", engine=None, stats_file: str | None = None,
                 **cfg) -> None:
        self.leaves = leaves or {"full": FULL}
        self.mem = [
            {leaf: LeafMemory(tuple(random_pages(next(_seeds)) for _ in range(tp)), replicated) for leaf in sorted(self.leaves)}
            for _ in range(replicas)
        ]
        if replicated:  # a replicated leaf holds the same bytes on every shard
            for rep in self.mem:
                for m in rep.values():
                    for t in m.shards[1:]:
                        t.copy_(m.shards[0])
        self.cfg = GdsKvConfig(store_path=store, **cfg)
        self.conn = GdsKvConnector(self.leaves, self.mem, model=model, dtype="float32", tokens_per_block=16,
                                   config=self.cfg, engine=engine, stats_file=stats_file)

    def page(self, leaf: str, block: int, shard: int = 0, replica: int = 0) -> torch.Tensor:
        return self.mem[replica][leaf].shards[shard][block]

    def offload(self, leaf_blocks: dict[str, list[int]], hashes: list[bytes], replica: int = 0):
        t = self.conn.offload(leaf_blocks, {leaf: hashes[: len(b)] for leaf, b in leaf_blocks.items()}, replica)
        t.synchronize()
        assert t.is_complete()
        return t

    def chunk(self, leaf: str, key: bytes, shard: int = 0) -> str:
        return self.conn.namespaces[shard].chunk_path(self.conn.layer_group(leaf), key)


@pytest.fixture
def rig(store_path) -> Rig:
    # the disk path (host tier off): corrupt or gated chunks must show in loads; with a host tier
    # the blocks this connector offloaded would be served from memory (tests/test_host_tier.py)
    r = Rig(store_path, host_bytes=0)
    yield r
    r.conn.shutdown()


def poll(transfer, timeout: float = 10.0) -> bool:
    """Poll ``is_complete`` as MAX's scheduler does, until True (or it raises)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if transfer.is_complete():
            return True
        time.sleep(0.005)
    raise AssertionError("transfer did not complete")


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def corrupt_payload(path: str, offset: int = 7) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# --- types --------------------------------------------------------------------------------------
@pytest.mark.skipif(MAX_AVAILABLE, reason="MAX is installed: its own types are used")
def test_local_types_stand_in_without_max():
    """Uses MAX's own types when importable, local equivalents with the same names otherwise."""
    e = KVLoadRefused("gone", leaf_id="full", block_hash=h8(1))
    assert (e.leaf_id, e.block_hash) == ("full", h8(1))
    assert CompletedTransfer().is_complete() and CompletedTransfer().g0_blocks_per_leaf == {}
    assert ByteCount(free=2, total=5).used == 3


@pytest.mark.skipif(not MAX_AVAILABLE, reason="MAX is not installed")
def test_maxs_own_types_when_max_is_installed(rig):
    """Under MAX, the exceptions, transfers and metrics are MAX's classes and protocols."""
    from max.nn.kv_cache.metrics import KVCacheMetrics as MaxMetrics
    from max.pipelines.kv_cache import kv_connector as kvc

    assert (KVLoadRefused, KVLoadFailed, CompletedTransfer) == (kvc.KVLoadRefused, kvc.KVLoadFailed, kvc.CompletedTransfer)
    offload = rig.conn.offload({"full": [1]}, {"full": [h8(1)]})
    assert isinstance(offload, kvc.KVConnectorTransfer)
    offload.synchronize()
    assert isinstance(rig.conn.load({"full": [2]}, {"full": [h8(1)]}), kvc.KVTransfer)
    assert isinstance(rig.conn.metrics, MaxMetrics) and isinstance(MaxMetrics() + rig.conn.metrics, MaxMetrics)


def test_identity(rig):
    """``name`` is for logs; ``leaves`` maps leaf id to group id; each leaf is a layer group."""
    assert rig.conn.name == "gdskv"
    assert rig.conn.leaves == {"full": FULL}
    assert rig.conn.layer_group("full") == 0
    assert rig.conn.host_byte_count == ByteCount(free=0, total=0)


# --- lookup -------------------------------------------------------------------------------------
@pytest.mark.parametrize("hash_of", [h8, h32], ids=["ahash64-8B", "sha256-32B"])
def test_offload_then_lookup_masks(store_path, hash_of):
    """Canonical 8- and 32-byte hashes are keys as given; masks are positional, one per leaf,
    exactly len(block_hashes) long."""
    r = Rig(store_path, leaves={"full": FULL, "win": WINDOW})
    try:
        hashes = [hash_of(i) for i in range(4)]
        r.offload({"full": [1, 2, 3, 4], "win": [5, 6]}, hashes)
        asked = [hashes[0], hash_of(99), hashes[1], hashes[2], hashes[3]]
        masks = r.conn.lookup(asked)
        assert set(masks) == {"full", "win"}
        assert all(len(m) == len(asked) for m in masks.values())
        assert list(masks["full"]) == [True, False, True, True, True]
        assert list(masks["win"]) == [True, False, True, False, False]  # the leaf is in the key
        assert r.conn.lookup([]) == {"full": [], "win": []}
    finally:
        r.conn.shutdown()


@pytest.mark.parametrize("bad, err", [(b"\x01" * 16, ValueError), (b"", ValueError), ("0123456789abcdef", TypeError)])
def test_bad_hash_is_a_clear_error(rig, bad, err):
    """Hashes are validated at the boundary: wrong length or type is a clear error, everywhere."""
    calls = [
        lambda: rig.conn.lookup([h8(1), bad]),
        lambda: rig.conn.probe([bad], [0]),
        lambda: rig.conn.start_lookup([bad]),
        lambda: rig.conn.load({"full": [1]}, {"full": [bad]}),
        lambda: rig.conn.offload({"full": [1]}, {"full": [bad]}),
    ]
    for call in calls:
        with pytest.raises(err) as info:
            call()
        assert "block_hashes[" in str(info.value)
    with pytest.raises(ValueError, match="8 or 32 bytes"):
        rig.conn.lookup([b"\x01" * 16])


def test_malformed_arguments(rig):
    """block_ids and block_hashes are the same length on every leaf; leaves are ours; replica
    and block ids are in range."""
    with pytest.raises(ValueError, match="2 block ids but 1 block hashes"):
        rig.conn.load({"full": [1, 2]}, {"full": [h8(1)]})
    with pytest.raises(ValueError, match="unknown leaf"):
        rig.conn.offload({"other": [1]}, {"other": [h8(1)]})
    with pytest.raises(ValueError, match="replica_idx"):
        rig.conn.lookup([h8(1)], replica_idx=1)
    with pytest.raises(ValueError, match="outside the pool"):
        rig.conn.offload({"full": [PAGES]}, {"full": [h8(1)]})


def test_lookup_is_not_a_reservation_eviction_then_load_is_refused(rig):
    """A block reported by lookup can be evicted before load asks for it: KVLoadRefused naming
    the leaf and the hash, nothing moved, the refusal counted."""
    hashes = [h8(i) for i in range(3)]
    rig.offload({"full": [1, 2, 3]}, hashes)
    assert all(rig.conn.lookup(hashes)["full"])
    os.unlink(rig.chunk("full", hashes[1]))  # what eviction does to a chunk file
    before = rig.page("full", 9).clone()
    with pytest.raises(KVLoadRefused) as info:
        rig.conn.load({"full": [8, 9, 10]}, {"full": hashes})
    assert info.value.leaf_id == "full" and info.value.block_hash == hashes[1]
    assert "'full'" in str(info.value) and hashes[1].hex() in str(info.value)
    assert torch.equal(rig.page("full", 9), before)
    m = rig.conn.take_metrics()
    assert m.connector_loads_refused == 1 and m.blocks_read == 0 and m.disk_bytes_read == 0


def test_budget_eviction_between_lookup_and_load_is_refused(store_path):
    """The same with gdskv's real byte budget: offloading newer blocks evicts the older ones."""
    chunk = BPP + 128
    r = Rig(store_path, max_bytes=4 * chunk)
    try:
        old = [h8(i) for i in range(4)]
        r.offload({"full": [0, 1, 2, 3]}, old)
        assert all(r.conn.lookup(old)["full"])
        time.sleep(0.02)
        r.offload({"full": [4, 5, 6, 7]}, [h8(100 + i) for i in range(4)])
        assert not all(r.conn.lookup(old)["full"])
        with pytest.raises(KVLoadRefused):
            r.conn.load({"full": [8, 9, 10, 11]}, {"full": old})
    finally:
        r.conn.shutdown()


# --- load ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hash_of", [h8, h32], ids=["ahash64-8B", "sha256-32B"])
def test_load_reads_exactly_the_blocks_it_is_told(store_path, hash_of):
    """block_hashes[leaf][i] is read into block_ids[leaf][i], leaf by leaf (counts may differ
    per leaf); blocks and bytes read are counted; take_metrics reads and clears."""
    r = Rig(store_path, leaves={"full": FULL, "win": WINDOW})
    try:
        hashes = [hash_of(i) for i in range(3)]
        r.offload({"full": [0, 1, 2], "win": [0, 1, 2]}, hashes)
        want_full = [r.page("full", b).clone() for b in (0, 1, 2)]
        want_win = r.page("win", 2).clone()
        t = r.conn.load({"full": [10, 11, 12], "win": [13]}, {"full": hashes, "win": hashes[2:]})
        assert poll(t)
        for b, want in zip((10, 11, 12), want_full):
            assert torch.equal(r.page("full", b), want)
        assert torch.equal(r.page("win", 13), want_win)
        m = r.conn.take_metrics()
        assert (m.blocks_read, m.disk_bytes_read) == (4, 4 * BPP)
        assert r.conn.take_metrics().blocks_read == 0
        assert r.conn.stats()["blocks_read"] == 4
        assert isinstance(r.conn.load({"full": []}, {"full": []}), CompletedTransfer)
    finally:
        r.conn.shutdown()


def test_corrupt_chunk_fails_every_poll_and_publishes_nothing(rig):
    """A copy that fails after it was posted raises KVLoadFailed from the transfer, on every
    poll; the failed block's page is untouched; nothing counts as loaded; the chunk is
    quarantined, so the next lookup misses it."""
    hashes = [h8(i) for i in range(3)]
    rig.offload({"full": [0, 1, 2]}, hashes)
    corrupt_payload(rig.chunk("full", hashes[1]))
    before = rig.page("full", 11).clone()
    t = rig.conn.load({"full": [10, 11, 12]}, {"full": hashes})
    t.synchronize()
    for _ in range(3):
        with pytest.raises(KVLoadFailed, match=hashes[1].hex()):
            t.is_complete()
    assert torch.equal(rig.page("full", 11), before)
    m = rig.conn.take_metrics()
    assert (m.load_failures, m.blocks_read, m.disk_bytes_read) == (1, 0, 0)
    assert m.connector_load_failures == 0  # MAX's cache manager counts that one itself
    assert list(rig.conn.lookup(hashes)["full"]) == [True, False, True]


def test_posting_failures(store_path):
    """KVLoadFailed when posting a load fails (here: the connector was shut down); an offload
    that cannot be posted is dropped and counted, never raised."""
    r = Rig(store_path)
    hashes = [h8(1)]
    r.offload({"full": [1]}, hashes)
    r.conn.shutdown()
    with pytest.raises(KVLoadFailed):
        r.conn.load({"full": [2]}, {"full": hashes})
    dropped = r.conn.offload({"full": [3]}, {"full": [h8(3)]})  # an offload that cannot post: dropped
    assert isinstance(dropped, CompletedTransfer) and r.conn.stats()["offload_blocks_dropped"] == 1


class GatedEngine(PosixEngine):
    """A POSIX engine whose reads and writes wait for ``gate``: a slow disk, made visible.
    Gates every call the transfer layer makes: ``read_now``/``write_now`` per page (``read``/
    ``write`` run them too), ``read_chunks_now``/``write_chunks_now`` per native slice, and
    ``read_chunks_later``/``write_chunks_later`` (which return at once, as the real ones do; the
    transfer starts once let go)."""

    def __init__(self) -> None:
        super().__init__(threads=4)
        self.gate = threading.Event()

    def read_now(self, path, segments):
        self.gate.wait(10)
        return super().read_now(path, segments)

    def write_now(self, path, segments):
        self.gate.wait(10)
        return super().write_now(path, segments)

    def read_chunks_now(self, root_fd, jobs, threads=1):
        self.gate.wait(10)
        return super().read_chunks_now(root_fd, jobs, threads)

    def write_chunks_now(self, root_fd, jobs, threads=1, dir_mode=None):
        self.gate.wait(10)
        return super().write_chunks_now(root_fd, jobs, threads, dir_mode)

    def read_chunks_later(self, *args):
        threading.Thread(target=lambda: self.gate.wait(10) and super(GatedEngine, self).read_chunks_later(*args)).start()

    def write_chunks_later(self, *args):
        threading.Thread(target=lambda: self.gate.wait(10) and super(GatedEngine, self).write_chunks_later(*args)).start()


def test_transfers_are_asynchronous_and_publish_only_when_written(store_path):
    """Each call hands back a transfer; a connector publishes an offloaded block only once its
    bytes are written; a load is not complete (and its page untouched) until its copy landed."""
    eng = GatedEngine()
    r = Rig(store_path, engine=eng, host_bytes=0)  # loads from the gated disk, not from memory
    try:
        hashes = [h8(1), h8(2)]
        t = r.conn.offload({"full": [1, 2]}, {"full": hashes})
        assert dict(t.g0_blocks_per_leaf) == {"full": [1, 2]}
        assert not t.is_complete()
        assert r.conn.metrics.inflight_disk_ops == 2
        assert r.conn.lookup(hashes)["full"] == [False, False]
        eng.gate.set()
        assert poll(t)
        assert r.conn.lookup(hashes)["full"] == [True, True]
        eng.gate.clear()
        before = r.page("full", 5).clone()
        t = r.conn.load({"full": [5]}, {"full": hashes[:1]})
        time.sleep(0.05)
        assert not t.is_complete() and torch.equal(r.page("full", 5), before)
        eng.gate.set()
        assert poll(t) and torch.equal(r.page("full", 5), r.page("full", 1))
        assert r.conn.metrics.inflight_disk_ops == 0
    finally:
        eng.gate.set()
        r.conn.shutdown()
        eng.close()


# --- offload ------------------------------------------------------------------------------------
def test_offload_skips_stored_blocks_and_reports_g0(rig):
    """g0_blocks_per_leaf are the device blocks it reads; a hash already stored is skipped; an
    offload that moves nothing is a CompletedTransfer pinned nowhere."""
    hashes = [h8(i) for i in range(3)]
    t = rig.offload({"full": [4, 5]}, hashes)
    assert dict(t.g0_blocks_per_leaf) == {"full": [4, 5]}
    t = rig.conn.offload({"full": [7, 8, 9]}, {"full": hashes})
    assert dict(t.g0_blocks_per_leaf) == {"full": [9]}
    t.synchronize()
    again = rig.conn.offload({"full": [7, 8, 9]}, {"full": hashes})
    assert isinstance(again, CompletedTransfer) and again.g0_blocks_per_leaf == {}
    s = rig.conn.stats()
    assert (s["blocks_written"], s["bytes_written"], s["offload_blocks_skipped"]) == (3, 3 * BPP, 5)


def test_offload_runs_are_chained_to_the_prefix_the_lookup_showed(rig):
    """MAX offloads a request's blocks a few at a time with no parent for a run's first block;
    the link comes from the lookup's root-anchored run, so every chunk names its parent and
    prefix-aware eviction sees one chain."""
    hashes = [h8(i) for i in range(4)]
    rig.conn.lookup(hashes)
    rig.offload({"full": [0, 1]}, hashes[:2])
    rig.conn.offload({"full": [2, 3]}, {"full": hashes[2:]}).synchronize()
    parents = [fmt.unpack(Path(rig.chunk("full", h)).read_bytes()[-fmt.TRAILER_BYTES:]).parent_key for h in hashes]
    assert parents == [None, hashes[0], hashes[1], hashes[2]]


def test_offload_dropped_by_budget_is_counted_not_raised(store_path):
    """A full budget drops the offload (counted per leaf block); the caller never sees an error."""
    r = Rig(store_path, max_bytes=BPP // 2)
    try:
        t = r.offload({"full": [1, 2]}, [h8(1), h8(2)])
        assert t.is_complete()
        m = r.conn.take_metrics()
        assert (m.connector_offload_blocks_dropped, m.blocks_written) == (2, 0)
        assert r.conn.lookup([h8(1)])["full"] == [False]
    finally:
        r.conn.shutdown()


# --- TP shards ----------------------------------------------------------------------------------
def test_presence_needs_every_tp_shard(store_path):
    """True means every TP shard of that leaf holds the block, not some shard; a load fills
    every shard from its own namespace."""
    r = Rig(store_path, tp=2)
    try:
        hashes = [h8(1), h8(2)]
        r.offload({"full": [1, 2]}, hashes)
        assert len({ns.id for ns in r.conn.namespaces}) == 2
        t = r.conn.load({"full": [6, 7]}, {"full": hashes})
        assert poll(t)
        for shard in (0, 1):
            assert torch.equal(r.page("full", 6, shard), r.page("full", 1, shard))
            assert torch.equal(r.page("full", 7, shard), r.page("full", 2, shard))
        assert (r.conn.take_metrics().blocks_read, r.conn.stats()["bytes_read"]) == (2, 4 * BPP)
        os.unlink(r.chunk("full", hashes[1], shard=1))
        assert r.conn.lookup(hashes)["full"] == [True, False]
        with pytest.raises(KVLoadRefused):
            r.conn.load({"full": [6, 7]}, {"full": hashes})
        t = r.conn.offload({"full": [1, 2]}, {"full": hashes})  # re-offloads the incomplete block
        assert dict(t.g0_blocks_per_leaf) == {"full": [2]}
    finally:
        r.conn.shutdown()


def test_replicated_leaf_is_stored_once_and_loaded_into_every_shard(store_path):
    """A replicated (MLA) leaf's identical shards are stored once, read once and broadcast
    back into every shard on load."""
    r = Rig(store_path, tp=2, replicated=True)
    try:
        r.offload({"full": [3]}, [h8(3)])
        assert os.path.exists(r.chunk("full", h8(3), shard=0))
        assert not os.path.exists(r.chunk("full", h8(3), shard=1))
        assert r.conn.lookup([h8(3)])["full"] == [True]
        assert poll(r.conn.load({"full": [9]}, {"full": [h8(3)]}))
        assert torch.equal(r.page("full", 9, 0), r.page("full", 3, 0))
        assert torch.equal(r.page("full", 9, 1), r.page("full", 3, 0))
        m = r.conn.take_metrics()  # the one chunk is read once, not once per shard
        assert (m.blocks_read, m.disk_bytes_read) == (1, BPP)
    finally:
        r.conn.shutdown()


def test_replica_selects_the_destination_only(store_path):
    """The external tier is replica-agnostic: written from replica 0, loaded into replica 1."""
    r = Rig(store_path, replicas=2)
    try:
        r.offload({"full": [2]}, [h8(2)], replica=0)
        assert r.conn.lookup([h8(2)], replica_idx=1)["full"] == [True]
        assert poll(r.conn.load({"full": [4]}, {"full": [h8(2)]}, replica_idx=1))
        assert torch.equal(r.page("full", 4, replica=1), r.page("full", 2, replica=0))
    finally:
        r.conn.shutdown()


# --- touch --------------------------------------------------------------------------------------
def test_touch_refreshes_recency_root_first_and_never_raises(store_path):
    """Fire-and-forget, never raises, missing keys tolerated; the touched run gets recency
    stamps in sequence order from the root, newer than before."""
    r = Rig(store_path)
    hashes = [h8(i) for i in range(4)]
    r.offload({"full": [0, 1, 2, 3]}, hashes)
    for k in hashes:
        os.utime(r.chunk("full", k), ns=(10**18, 10**18))
    assert r.conn.touch([hashes[0], h8(77), hashes[1], hashes[2], hashes[3]]) is None
    assert r.conn.touch([b"short", 42]) is None  # malformed: ignored, not raised
    r.conn.shutdown()  # waits for the background touch
    stamps = [os.stat(r.chunk("full", k)).st_mtime_ns for k in hashes]
    assert stamps == sorted(stamps) and stamps[0] > 10**18
    assert r.conn.stats()["touches"] == 1
    assert r.conn.touch(hashes) is None  # after shutdown: still silent


# --- start_lookup / abandon / load_lookup / probe ------------------------------------------------
def test_start_lookup_answers_in_the_background(store_path):
    """defers_lookup says start_lookup may return before it answers; the handle carries the same
    answer as lookup; under a budget it holds pins until abandon_lookup releases them."""
    r = Rig(store_path, max_bytes=1 << 20)
    try:
        hashes = [h8(i) for i in range(3)]
        r.offload({"full": [0, 1, 2]}, hashes)
        assert r.conn.defers_lookup() is True
        asked = hashes + [h8(50)]
        handle = r.conn.start_lookup(asked)
        assert isinstance(handle, GdsKvLookup)
        wait_for(handle.is_complete)
        assert handle.result() == r.conn.lookup(asked)
        assert handle.pinned == 3
        r.conn.abandon_lookup(handle)
        assert handle.pinned == 0
        r.conn.abandon_lookup(handle)  # twice: still fine
        r.conn.abandon_lookup(object())  # not ours: ignored
    finally:
        r.conn.shutdown()


def test_abandon_before_the_answer_leaves_nothing_pinned(store_path):
    """abandon_lookup is safe on a handle that has not answered yet."""
    r = Rig(store_path, max_bytes=1 << 20)
    try:
        r.offload({"full": [0]}, [h8(0)])
        gate = threading.Event()
        real = r.conn._lookups.masks
        r.conn._lookups.masks = lambda keys, lease=False: (gate.wait(10), real(keys, lease))[1]  # a slow round trip
        handle = r.conn.start_lookup([h8(0)])
        assert not handle.is_complete()
        r.conn.abandon_lookup(handle)
        gate.set()
        wait_for(handle.is_complete)
        assert handle.result() == {"full": [True]} and handle.pinned == 0
        assert sum(r.conn.service.store.budget._pins.values()) == 0
    finally:
        r.conn.shutdown()


def test_load_lookup_consumes_the_handle(store_path):
    """load_lookup loads as load does, out of a completed lookup, and consumes the handle."""
    r = Rig(store_path, max_bytes=1 << 20)
    try:
        hashes = [h8(i) for i in range(3)]
        r.offload({"full": [0, 1, 2]}, hashes)
        handle = r.conn.start_lookup(hashes)
        wait_for(handle.is_complete)
        t = r.conn.load_lookup(handle, {"full": [8, 9]}, {"full": hashes[1:]})
        assert handle.pinned == 0
        assert poll(t) and torch.equal(r.page("full", 9), r.page("full", 2))
        assert sum(r.conn.service.store.budget._pins.values()) == 0
        failed = r.conn.start_lookup(hashes)
        wait_for(failed.is_complete)
        os.unlink(r.chunk("full", hashes[0]))
        with pytest.raises(KVLoadRefused):  # the lookup's pins do not stop a plain unlink...
            r.conn.load_lookup(failed, {"full": [8]}, {"full": hashes[:1]})
        assert failed.pinned == 0  # ...and the handle is consumed however load_lookup exits
    finally:
        r.conn.shutdown()


def test_unclaimed_lookup_lease_expires_on_poll(store_path, monkeypatch):
    """A connector that keeps state between lookup and load bounds it itself."""
    monkeypatch.setattr(max_lookups, "LOOKUP_LEASE_SECONDS", 0.0)
    r = Rig(store_path, max_bytes=1 << 20)
    try:
        r.offload({"full": [0]}, [h8(0)])
        handle = r.conn.start_lookup([h8(0)])
        wait_for(handle.is_complete)
        assert handle.pinned == 1
        r.conn.poll_transfers()
        assert handle.pinned == 0
    finally:
        r.conn.shutdown()


@pytest.mark.parametrize("deferred", [True, False], ids=["start_lookup", "lookup"])
def test_what_start_lookup_found_is_not_evicted_before_the_load(store_path, deferred):
    """A connector that keeps state between lookup and load stays correct: the blocks a
    start_lookup found are leased in the store, so no process's eviction (here another
    connector's byte budget on the same store) removes them before load_lookup; a plain lookup
    holds nothing, and the same eviction takes them."""
    chunk = BPP + 128
    a = Rig(store_path)
    old = [h8(i) for i in range(4)]
    a.offload({"full": [0, 1, 2, 3]}, old)
    handle = a.conn.start_lookup(old) if deferred else None
    if deferred:
        wait_for(handle.is_complete)
        assert handle.result() == {"full": [True] * 4} and handle.pinned == 4
    else:
        assert a.conn.lookup(old) == {"full": [True] * 4}
    other = Rig(store_path, max_bytes=4 * chunk)  # another process, its budget full
    try:
        time.sleep(0.02)
        other.offload({"full": [4, 5, 6, 7]}, [h8(100 + i) for i in range(4)])
        dropped = other.conn.take_metrics().connector_offload_blocks_dropped
        if not deferred:
            assert dropped < 4 and not all(a.conn.lookup(old)["full"])
            return
        assert dropped == 4 and all(a.conn.lookup(old)["full"])
        t = a.conn.load_lookup(handle, {"full": [8, 9, 10, 11]}, {"full": old})
        assert poll(t) and all(torch.equal(a.page("full", 8 + i), a.page("full", i)) for i in range(4))
        assert handle.pinned == 0
    finally:
        other.conn.shutdown()
        a.conn.shutdown()


def test_chunks_a_load_waits_to_read_are_not_evicted_meanwhile(store_path):
    """load leases every chunk before it posts the reads, so eviction in another process leaves
    them alone while the reads wait (a slow disk)."""
    eng = GatedEngine()
    eng.gate.set()
    a = Rig(store_path, engine=eng)
    other = None
    try:
        hashes = [h8(i) for i in range(4)]
        a.offload({"full": [0, 1, 2, 3]}, hashes)
        eng.gate.clear()
        t = a.conn.load({"full": [8, 9, 10, 11]}, {"full": hashes})
        other = Rig(store_path, max_bytes=4 * (BPP + 128))
        time.sleep(0.02)
        other.offload({"full": [4, 5, 6, 7]}, [h8(100 + i) for i in range(4)])
        assert other.conn.take_metrics().connector_offload_blocks_dropped == 4
        assert all(a.conn.lookup(hashes)["full"])
        eng.gate.set()
        assert poll(t) and all(torch.equal(a.page("full", 8 + i), a.page("full", i)) for i in range(4))
    finally:
        eng.gate.set()
        if other is not None:
            other.conn.shutdown()
        a.conn.shutdown()
        eng.close()


def test_probe_answers_per_replica_without_taking_anything(store_path):
    """One answer per replica, shaped as lookup's, read without the pins a lookup takes."""
    r = Rig(store_path, replicas=2, max_bytes=1 << 20)
    try:
        hashes = [h8(0), h8(1)]
        r.offload({"full": [0]}, hashes)
        answers = r.conn.probe(hashes, [0, 1])
        assert len(answers) == 2
        assert all(a == {"full": [True, False]} for a in answers)
        assert sum(r.conn.service.store.budget._pins.values()) == 0
    finally:
        r.conn.shutdown()


# --- occupancy, restart, namespaces -------------------------------------------------------------
def test_disk_byte_count_reports_real_occupancy(store_path):
    r = Rig(store_path)
    try:
        r.offload({"full": [0, 1, 2]}, [h8(0), h8(1), h8(2)])
        on_disk = 3 * (BPP + 128)
        r.conn.disk_byte_count  # starts the background measurement
        wait_for(lambda: r.conn.disk_byte_count.used == on_disk)
        assert r.conn.disk_byte_count.free > 0
    finally:
        r.conn.shutdown()
    b = Rig(store_path, max_bytes=100 * BPP)
    try:
        count = b.conn.disk_byte_count
        assert count.total == 100 * BPP and count.used == 3 * (BPP + 128)
    finally:
        b.conn.shutdown()


def test_restart_finds_what_was_published_and_other_models_miss(store_path):
    """The store is the source of truth: a new connector (a restart, another process) sees every
    published block; a different model is another namespace, a miss rather than a wrong load."""
    a = Rig(store_path)
    a.offload({"full": [0, 1]}, [h8(0), h8(1)])
    a.conn.shutdown()
    b = Rig(store_path)
    other = Rig(store_path, model="another-model")
    try:
        assert b.conn.lookup([h8(0), h8(1)])["full"] == [True, True]
        assert poll(b.conn.load({"full": [5]}, {"full": [h8(1)]}))
        assert torch.equal(b.page("full", 5), a.page("full", 1))
        assert other.conn.lookup([h8(0)])["full"] == [False]
    finally:
        b.conn.shutdown()
        other.conn.shutdown()


def test_stats_file_and_shutdown(store_path, tmp_path):
    """Lifetime counters persist to a JSON file at shutdown (how the MAX integration test reads
    a worker's counters); shutdown is idempotent."""
    path = tmp_path / "stats.json"
    r = Rig(store_path, stats_file=str(path))
    r.offload({"full": [0]}, [h8(0)])
    r.conn.shutdown()
    r.conn.shutdown()
    data = json.loads(path.read_text())
    assert data["blocks_written"] == 1 and data["bytes_written"] == BPP


_EXIT_WITHOUT_SHUTDOWN = """
import sys, types, torch
from gdskv.connectors.max.types import KVCacheGroupId
from gdskv.connectors.max.wiring import create_gdskv_connector
pages = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
params = types.SimpleNamespace(kv_hash_algo="ahash64", kv_hash_seed=None, num_layers=2,
                               dtype=types.SimpleNamespace(name="float32"), page_size=16)
conn = create_gdskv_connector({"full": KVCacheGroupId.full()}, [types.SimpleNamespace(label="cpu")],
                              [{"full": types.SimpleNamespace(buffers=[pages], replicated=False)}], params, 0)
conn.offload({"full": [0, 1, 2]}, {"full": [i.to_bytes(8, "big") for i in (1, 2, 3)]}, 0)
print(conn.namespaces[0].id)
del conn  # as MAX drops its pipeline
"""


def test_a_process_that_ends_without_shutdown_still_settles_its_offloads(tmp_path):
    """``max generate`` drops its pipeline and exits without calling its cache manager's
    ``shutdown``: the connector MAX built (``create_gdskv_connector``) is kept and shut down at
    exit, so an offload nobody polled again is written and its blocks are in the counters file."""
    import subprocess
    import sys

    store, stats = tmp_path / "store", tmp_path / "stats.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_")}
    env.update({"GDSKV_STORE": str(store), gmax.ENV_METRICS: str(stats), gmax.ENV_MODEL: "tiny"})
    run = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_SHUTDOWN], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(stats.read_text())
    assert data["blocks_written"] == 3 and data["bytes_written"] == 3 * 4096 and data["offload_blocks_dropped"] == 0
    assert len([p for p in (store / "ns" / run.stdout.strip()).rglob("*") if p.is_file() and p.parent.name == "0"]) == 3


_TERMINATED_WITH_OFFLOADS_IN_FLIGHT = """
import time, types, torch
from gdskv.connectors.max.types import KVCacheGroupId
from gdskv.connectors.max.wiring import create_gdskv_connector
blocks = 512
pages = torch.randint(0, 256, (blocks, 65536), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
params = types.SimpleNamespace(kv_hash_algo="ahash64", kv_hash_seed=None, num_layers=2,
                               dtype=types.SimpleNamespace(name="float32"), page_size=16)
conn = create_gdskv_connector({"full": KVCacheGroupId.full()}, [types.SimpleNamespace(label="cpu")],
                              [{"full": types.SimpleNamespace(buffers=[pages], replicated=False)}], params, 0)
conn.offload({"full": list(range(blocks))}, {"full": [i.to_bytes(8, "big") for i in range(1, blocks + 1)]}, 0)
print(conn.namespaces[0].id, flush=True)
while True:  # as MAX's model worker loops, sleeping at most 10 ms between scheduler iterations
    time.sleep(0.01)
"""


def test_a_worker_terminated_with_offloads_in_flight_writes_them_before_it_exits(tmp_path):
    """MAX ends its model worker with SIGTERM (SIGKILL five seconds later), whose default action
    ends a process at once: the connector makes SIGTERM an exit through the interpreter's exit
    handlers, so 32 MiB of offloads still being written when it arrives are written, settled and
    counted, and the process ends with status 143."""
    import signal
    import subprocess
    import sys

    store, stats = tmp_path / "store", tmp_path / "stats.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_")}
    env.update({"GDSKV_STORE": str(store), gmax.ENV_METRICS: str(stats), gmax.ENV_MODEL: "tiny"})
    proc = subprocess.Popen([sys.executable, "-c", _TERMINATED_WITH_OFFLOADS_IN_FLIGHT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        ns = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert ns and proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    data = json.loads(stats.read_text())
    assert data["blocks_written"] == 512 and data["bytes_written"] == 512 * 65536 and data["inflight_disk_ops"] == 0
    assert len([p for p in (store / "ns" / ns).rglob("*") if p.is_file() and p.parent.name == "0"]) == 512


def test_model_identity_is_required(monkeypatch):
    """KV of two models is never shared: no model id is a bring-up error naming the setting."""
    monkeypatch.delenv(gmax.ENV_MODEL, raising=False)
    with pytest.raises(ConfigError, match="model_id"):
        model_identity(GdsKvConfig(store_path="/nonexistent"))
    assert model_identity(GdsKvConfig(store_path="/x", model_id="m")) == "m"
    monkeypatch.setenv(gmax.ENV_MODEL, "from-env")
    assert model_identity(GdsKvConfig(store_path="/x")) == "from-env"


def test_leaf_memory_is_validated():
    with pytest.raises(ValueError, match="2-D uint8"):
        LeafMemory((torch.zeros(4, 8, dtype=torch.float32),))
    with pytest.raises(ValueError, match="shard 1"):
        LeafMemory((torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(5, 8, dtype=torch.uint8)))
    padded = torch.zeros(4, 16, dtype=torch.uint8)[:, :8]  # rows padded apart: fine
    assert LeafMemory((padded,)).bytes_per_page == 8


def test_launcher_reads_the_model_from_argv(tmp_path, monkeypatch):
    """The launcher names the namespace's model after ``--model-path`` (absolute for a local dir)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert model_from_argv(["generate", "--model-path", "m", "--devices", "cpu"]) == str(tmp_path / "m")
    assert model_from_argv(["serve", "--model=org/name"]) == "org/name"
    assert model_from_argv(["generate", "--prompt", "x"]) is None
