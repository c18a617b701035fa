"""Device ordering: no transfer thread touches a page before the engine's stream is done with it.

``gdskv.streams.use(FakeOrdering)`` stands in for CUDA: every readiness a connector records is a
gate on a fake stream that the test releases late (as a GPU would finish the step's kernels
late), and every step is logged. The I/O engine under the transfer threads is wrapped to log its
reads and writes. Each scenario checks, for TensorRT-LLM loads and saves and MAX loads and
offloads, that

- the readiness was recorded on the engine's stream (TensorRT-LLM's ``stream`` argument; for MAX,
  the stream of the pages' device),
- no page byte moved before the test released the stream, every I/O of a transfer thread came
  after its ``synchronize()`` (and a MAX load's copy from scratch into its pages after that), and
- the bytes that moved are the ones the kernels left (saves store the final page, loads did not
  overwrite a slot its previous kernels were still using).

Each has a negative control: the same scenario with the readiness removed (``ready=None`` passed
to ``PageTransfer``) fails. The last tests check the CPU paths without a fake: a sliding-window
save never blocks ``wait_for_save`` and stores the page as it was when the save was posted even
if the cache reuses the page at once; and the zero-copy rules for MAX buffers.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np
import pytest
import torch

from gdskv import streams
from gdskv.config import GdsKvConfig
from gdskv.connectors import max as gmax
from gdskv.connectors.max import GdsKvConnector, LeafMemory
from gdskv.connectors.max.types import KVCacheGroupId
from gdskv.connectors.trtllm import GdsKvScheduler, GdsKvWorker, StandaloneLlmArgs
from gdskv.engine.requests import RequestData, SchedulerOutput
from gdskv.io.posix import PosixEngine
from gdskv.layout import GroupPools, KvCacheBufferRef, layout_from_group_tensors

TPB = 4
MODEL = "test/ordering"
PROMPT = list(range(3, 26))  # 23 tokens: 5 full blocks
QUIET = 0.3
"""How long a scenario lets a transfer thread misbehave before the test releases the stream (a
negative control waits up to ``QUIET_NEGATIVE``, stopping as soon as something moved)."""
QUIET_NEGATIVE = 5.0


# --- the fake device -----------------------------------------------------------------------------
class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class Gate:
    """A readiness recorded on a fake stream: ``synchronize`` blocks until the test releases it."""

    def __init__(self, owner: "FakeOrdering", stream: Any) -> None:
        self.owner, self.stream = owner, stream
        self.released = threading.Event()

    def synchronize(self) -> None:
        assert self.released.wait(10), "a readiness was never released"
        self.owner.note("synchronized", self.stream)


class SnapshotGate(Gate):
    """The readiness of a snapshot queued on a fake stream: the copy runs when the stream gets
    there (when the test releases it), seen by whoever synchronizes first."""

    def __init__(self, owner: "FakeOrdering", stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(owner, stream)
        self.pairs, self.done, self.mu = pairs, False, threading.Lock()

    def synchronize(self) -> None:
        super().synchronize()
        with self.mu:
            if not self.done:
                for dst, src in self.pairs:
                    dst.copy_(src)
                self.done = True


class FakeOrdering:
    """``gdskv.streams``' ordering over fake streams, logging ``(what, stream or None, thread)``."""

    def __init__(self) -> None:
        self.current = FakeStream("current")
        self.log: list[tuple[str, Any, str]] = []
        self.gates: list[Gate] = []
        self.mu = threading.Lock()

    def note(self, what: str, stream: Any = None) -> None:
        with self.mu:
            self.log.append((what, stream, threading.current_thread().name))

    def stream_of(self, device: Any) -> FakeStream:
        return self.current

    def record(self, stream: Any) -> Gate:
        g = Gate(self, stream)
        self.gates.append(g)
        self.note("recorded", stream)
        return g

    def snapshot(self, segments, stream):
        copies = [torch.full_like(s, 0xA5) for s in segments]  # what the copy finds before it ran
        g = SnapshotGate(self, stream, list(zip(copies, segments)))
        self.gates.append(g)
        self.note("recorded", stream)
        return copies, g

    def copy_into(self, pages, src) -> None:
        self.note("copy")
        for p in pages:
            p.copy_(src)

    def release(self) -> None:
        self.note("released")
        for g in self.gates:
            g.released.set()

    def moved(self) -> bool:
        with self.mu:
            return any(what in ("io", "copy") for what, _, _ in self.log)


class LoggingEngine:
    """An I/O engine that logs every read and write of a transfer thread (per page and per
    native slice), then does it."""

    def __init__(self, inner: Any, fake: FakeOrdering) -> None:
        self._inner, self._fake = inner, fake

    def read_now(self, path, segments):
        self._fake.note("io")
        return self._inner.read_now(path, segments)

    def write_now(self, path, segments):
        self._fake.note("io")
        return self._inner.write_now(path, segments)

    def read_chunks_now(self, root_fd, jobs, threads=1):
        self._fake.note("io")
        return self._inner.read_chunks_now(root_fd, jobs, threads)

    def write_chunks_now(self, root_fd, jobs, threads=1, dir_mode=None):
        self._fake.note("io")
        return self._inner.write_chunks_now(root_fd, jobs, threads, dir_mode)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def drop_readiness(monkeypatch, transfer) -> None:
    """The negative control: this ``PageTransfer`` gets ``ready=None`` whatever it is passed."""
    save, load = transfer.save_pages, transfer.load_pages  # save_page / load_page go through these
    monkeypatch.setattr(transfer, "save_pages", lambda group, items, ready=None, **kw: save(group, items, **kw))
    monkeypatch.setattr(transfer, "load_pages", lambda group, items, ready=None, **kw: load(group, items, **kw))


def let_it_misbehave(fake: FakeOrdering, drop: bool) -> None:
    """Give transfer threads time to move bytes they must not move yet."""
    end = time.monotonic() + (QUIET_NEGATIVE if drop else QUIET)
    while time.monotonic() < end and not fake.moved():
        time.sleep(0.005)
    time.sleep(0.02)


def assert_ordered(fake: FakeOrdering, engine_stream: Any) -> None:
    """Nothing moved before the release; each transfer thread synchronized a readiness recorded
    on ``engine_stream`` before its first I/O or copy."""
    log = list(fake.log)
    whats = [w for w, _, _ in log]
    assert "released" in whats
    released = whats.index("released")
    moves = [i for i, (w, _, _) in enumerate(log) if w in ("io", "copy")]
    assert moves, "nothing moved"
    early = [log[i] for i in moves if i < released]
    assert not early, f"page bytes moved before the engine's stream released them: {early}"
    for i in moves:  # a MAX load's copy into its pages follows its read (another thread) by a future
        thread = log[i][2] if log[i][0] == "io" else None
        assert any(w == "synchronized" and s is engine_stream and thread in (None, t) for w, s, t in log[:i]), \
            f"{log[i]} without a synchronize() of a readiness on {engine_stream} first"
    assert all(s is engine_stream for w, s, _ in log if w == "recorded")


# --- TensorRT-LLM ------------------------------------------------------------------------------
class TrtRig:
    """One scheduler and worker over a two-group pool (full attention: layers 0, 2; a 64-token
    window: layers 1, 3), driven the way the runtime drives them."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors: list[torch.Tensor] = []
        groups = []
        for w, layers in ((None, (0, 2)), (64, (1, 3))):
            k, v = (torch.randn(16, 2, TPB * 8, generator=g) for _ in range(2))
            self.tensors += [k, v]
            groups.append(GroupPools(w, layers, [k, v], [[KvCacheBufferRef(l, "key") for l in layers],
                                                         [KvCacheBufferRef(l, "value") for l in layers]]))
        self.layout = layout_from_group_tensors(groups, TPB, torch.float32)
        args = StandaloneLlmArgs.build(MODEL, TPB)
        self.worker = GdsKvWorker(args)
        self.worker.register_kv_cache_layout(self.layout)
        self.scheduler = GdsKvScheduler(args)
        self.pages = [list(range(6)), list(range(6))]

    def page(self, gid: int, slot: int) -> bytes:
        return b"".join(r.slot_tensor(slot).numpy().tobytes() for r in self.layout.group(gid).regions)

    def all_pages(self) -> dict[tuple[int, int], bytes]:
        return {(gid, s): self.page(gid, s) for gid in (0, 1) for s in range(6)}

    def admit(self, rid: int = 1):
        req = type("Req", (), {"request_id": rid, "cache_salt": None, "get_tokens": lambda self, beam: list(PROMPT)})()
        n, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        self.scheduler.update_state_after_alloc_by_layer_group(req, self.pages)
        out = SchedulerOutput()
        out.new_requests.append(RequestData(rid, list(PROMPT), [], [list(p) for p in self.pages], n, len(PROMPT) - n))
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_meta(meta)
        return req, n, meta

    def finish(self, req) -> None:
        if self.scheduler.request_finished_by_layer_group(req, self.pages):
            given, end = [req.request_id], time.monotonic() + 10
            while not self.worker.get_finished(given, [])[0]:
                given = []
                assert time.monotonic() < end, "saves never finished"
                time.sleep(0.005)

    def chunk_payload(self, gid: int, key: bytes) -> bytes:
        n = self.layout.group(gid).bytes_per_page
        with open(self.worker.namespace.chunk_path(gid, key), "rb") as f:
            return f.read(n)


@pytest.fixture
def trt_store(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_STORE", str(tmp_path / "store"))


def trtllm_save_scenario(monkeypatch, drop: bool) -> None:
    rig = TrtRig(seed=1)
    fake = FakeOrdering()
    rig.worker._transfer.engine = LoggingEngine(rig.worker._transfer.engine, fake)
    if drop:
        drop_readiness(monkeypatch, rig.worker._transfer)
    engine_stream = FakeStream("forward")
    try:
        with streams.use(fake):
            req, _, meta = rig.admit()
            rig.worker.start_load_kv(engine_stream)
            for layer in range(4):
                rig.worker.wait_for_layer_load(layer, engine_stream)
                rig.worker.save_kv_layer(layer, engine_stream)
            let_it_misbehave(fake, drop)
            for t in rig.tensors:  # the step's kernels finish writing the pages only now
                t.add_(1.0)
            final = rig.all_pages()
            fake.release()
            rig.worker.wait_for_save(engine_stream)
            rig.finish(req)
        saves = [(gid, op) for gid in (0, 1) for _, op in meta.saves_of_group(gid)]
        assert {gid for gid, _ in saves} == {0, 1} and len(saves) == 10
        for gid, op in saves:
            assert rig.chunk_payload(gid, op.key) == final[(gid, op.page_slot)], f"group {gid} slot {op.page_slot} saved stale"
        assert_ordered(fake, engine_stream)
    finally:
        fake.release()
        rig.worker.close()


def trtllm_load_scenario(monkeypatch, drop: bool) -> None:
    source = TrtRig(seed=2)
    req, _, _ = source.admit()
    source.worker.start_load_kv(None)
    for layer in range(4):
        source.worker.save_kv_layer(layer, None)
    source.worker.wait_for_save(None)
    source.finish(req)
    stored = source.all_pages()
    source.worker.close()

    rig = TrtRig(seed=3)
    fake = FakeOrdering()
    rig.worker._transfer.engine = LoggingEngine(rig.worker._transfer.engine, fake)
    if drop:
        drop_readiness(monkeypatch, rig.worker._transfer)
    engine_stream = FakeStream("forward")
    try:
        before = rig.all_pages()
        with streams.use(fake):
            req, n, meta = rig.admit(rid=2)
            assert n == 20
            rig.worker.start_load_kv(engine_stream)
            let_it_misbehave(fake, drop)
            assert rig.all_pages() == before, "a load wrote a slot the previous step's kernels were still using"
            fake.release()
            for layer in range(4):
                rig.worker.wait_for_layer_load(layer, engine_stream)
        loads = [(gid, op) for gid in (0, 1) for _, op in meta.loads_of_group(gid)]
        assert len(loads) == 10
        for gid, op in loads:
            assert rig.page(gid, op.page_slot) == stored[(gid, op.page_slot)]
        assert rig.worker.counters.loads_loaded == 10
        assert_ordered(fake, engine_stream)
    finally:
        fake.release()
        rig.worker.close()


def test_trtllm_saves_read_pages_only_after_the_engines_stream(trt_store, monkeypatch):
    trtllm_save_scenario(monkeypatch, drop=False)


def test_trtllm_saves_without_readiness_fail_the_check(trt_store, monkeypatch):
    with pytest.raises(AssertionError):
        trtllm_save_scenario(monkeypatch, drop=True)


def test_trtllm_loads_write_slots_only_after_the_engines_stream(trt_store, monkeypatch):
    trtllm_load_scenario(monkeypatch, drop=False)


def test_trtllm_loads_without_readiness_fail_the_check(trt_store, monkeypatch):
    with pytest.raises(AssertionError):
        trtllm_load_scenario(monkeypatch, drop=True)


class HeldEngine:
    """An I/O engine whose writes wait until the test lets them go."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.go = inner, threading.Event()

    def write_now(self, path, segments):
        assert self.go.wait(10)
        return self._inner.write_now(path, segments)

    def write_chunks_now(self, root_fd, jobs, threads=1, dir_mode=None):
        assert self.go.wait(10)
        return self._inner.write_chunks_now(root_fd, jobs, threads, dir_mode)

    def write_chunks_later(self, *args):  # returns at once, as the real one does; the writes start once let go
        threading.Thread(target=lambda: self.go.wait(10) and self._inner.write_chunks_later(*args)).start()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_sliding_window_save_never_blocks_the_step_and_survives_page_reuse(trt_store):
    """No fake: the reference engine's path (no stream, host pages). With the disk held,
    ``wait_for_save`` returns at once; the window's pages are then reused by the cache (the next
    step overwrites them); once the disk lets go, the store holds the pages as the step left
    them, and ``get_finished`` reports the request only then."""
    rig = TrtRig(seed=4)
    held = HeldEngine(rig.worker._transfer.engine)
    rig.worker._transfer.engine = held
    try:
        req, _, meta = rig.admit()
        rig.worker.start_load_kv(None)
        for layer in range(4):
            rig.worker.save_kv_layer(layer, None)
        left = rig.all_pages()
        t0 = time.monotonic()
        rig.worker.wait_for_save(None)
        assert time.monotonic() - t0 < 1.0
        assert rig.worker.get_finished([req.request_id], []) == ([], [])
        rig.tensors[2].fill_(-7.0)  # group 1 (the window): its pages reclaimed and rewritten
        rig.tensors[3].fill_(-7.0)
        held.go.set()
        given, end = [], time.monotonic() + 10
        while not rig.worker.get_finished(given, [])[0]:
            assert time.monotonic() < end
            time.sleep(0.005)
        for _, op in meta.saves_of_group(1):
            assert rig.chunk_payload(1, op.key) == left[(1, op.page_slot)]
    finally:
        held.go.set()
        rig.worker.close()


# --- MAX -----------------------------------------------------------------------------------------
class MaxRig:
    def __init__(self, store: str, fake: Optional[FakeOrdering] = None, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pages = torch.randint(0, 256, (8, 256), dtype=torch.uint8, generator=g)
        engine: Any = PosixEngine()
        if fake is not None:
            engine = LoggingEngine(engine, fake)
        self.conn = GdsKvConnector({"full": KVCacheGroupId.full()}, [{"full": LeafMemory((self.pages,))}],
                                   model="m", dtype="uint8", tokens_per_block=16,
                                   config=GdsKvConfig(store_path=store), engine=engine)

    def chunk_payload(self, key: bytes) -> bytes:
        with open(self.conn.namespaces[0].chunk_path(0, key), "rb") as f:
            return f.read(256)


KEYS = [i.to_bytes(8, "big") for i in range(1, 5)]


def max_offload_scenario(store: str, monkeypatch, drop: bool) -> None:
    fake = FakeOrdering()
    rig = MaxRig(store, fake, seed=5)
    if drop:
        drop_readiness(monkeypatch, rig.conn.service.transfers[0])
    try:
        with streams.use(fake):
            t = rig.conn.offload({"full": [0, 1, 2, 3]}, {"full": KEYS})
            let_it_misbehave(fake, drop)
            rig.pages[:4] += 1  # the step that wrote the blocks ends only now
            final = [rig.pages[i].numpy().tobytes() for i in range(4)]
            fake.release()
            t.synchronize()
        assert [rig.chunk_payload(k) for k in KEYS] == final
        assert_ordered(fake, fake.current)
    finally:
        fake.release()
        rig.conn.shutdown()


def max_load_scenario(store: str, monkeypatch, drop: bool) -> None:
    source = MaxRig(store, seed=6)
    source.conn.offload({"full": [0, 1, 2, 3]}, {"full": KEYS}).synchronize()
    stored = [source.pages[i].clone() for i in range(4)]
    source.conn.shutdown()

    fake = FakeOrdering()
    rig = MaxRig(store, fake, seed=7)
    if drop:
        drop_readiness(monkeypatch, rig.conn.service.transfers[0])
    try:
        before = rig.pages.clone()
        with streams.use(fake):
            t = rig.conn.load({"full": [4, 5, 6, 7]}, {"full": KEYS})
            let_it_misbehave(fake, drop)
            assert torch.equal(rig.pages, before), "a load wrote a slot the engine's kernels were still using"
            assert not t.is_complete()
            fake.release()
            t.synchronize()
            assert t.is_complete()
        assert all(torch.equal(rig.pages[4 + i], stored[i]) for i in range(4))
        assert_ordered(fake, fake.current)
    finally:
        fake.release()
        rig.conn.shutdown()


def test_max_offloads_read_blocks_only_after_the_engines_stream(store_path, monkeypatch):
    max_offload_scenario(store_path, monkeypatch, drop=False)


def test_max_offloads_without_readiness_fail_the_check(store_path, monkeypatch):
    with pytest.raises(AssertionError):
        max_offload_scenario(store_path, monkeypatch, drop=True)


def test_max_loads_write_blocks_only_after_the_engines_stream(store_path, monkeypatch):
    max_load_scenario(store_path, monkeypatch, drop=False)


def test_max_loads_without_readiness_fail_the_check(store_path, monkeypatch):
    with pytest.raises(AssertionError):
        max_load_scenario(store_path, monkeypatch, drop=True)


def test_max_orders_on_the_stream_max_runs_on_when_it_is_known(store_path):
    """``engine_streams`` (from MAX's devices) takes precedence over the device's current stream."""
    fake = FakeOrdering()
    rig = MaxRig(store_path, fake, seed=8)
    mine = FakeStream("max-default")
    rig.conn._engine_streams = {torch.device("cpu"): mine}
    try:
        with streams.use(fake):
            t = rig.conn.offload({"full": [0]}, {"full": KEYS[:1]})
            fake.release()
            t.synchronize()
        assert_ordered(fake, mine)
    finally:
        rig.conn.shutdown()


# --- the real ordering without a GPU, and zero-copy views -------------------------------------------
def test_cuda_ordering_has_nothing_to_wait_for_on_host_memory():
    assert streams.record_ready(None, [torch.device("cpu")]) is None
    assert streams.record_ready(None, []) is None
    page = torch.arange(8, dtype=torch.uint8)
    copies, ready = streams.snapshot([page], None, torch.device("cpu"))
    page.fill_(0)
    assert ready is None and copies[0].tolist() == list(range(8))
    dst = [torch.zeros(8, dtype=torch.uint8) for _ in range(2)]
    streams.copy_into(dst, copies[0])
    assert all(d.tolist() == list(range(8)) for d in dst)


class _Device:
    def __init__(self, host: bool) -> None:
        self.is_host, self.label = host, "cpu" if host else "gpu"

    def __repr__(self) -> str:
        return "Device(cpu)" if self.is_host else "Device(gpu:0)"


class _NoDlpack:
    def __dlpack__(self, *a, **k):
        raise BufferError("no export")

    def __dlpack_device__(self):
        raise BufferError("no export")


class DeviceBuffer(_NoDlpack):
    device = _Device(host=False)

    def to_numpy(self):  # what a device buffer's to_numpy does: a host copy
        return np.zeros((4, 16), dtype=np.uint8)


class CopyingHostBuffer(_NoDlpack):
    device = _Device(host=True)

    def __init__(self) -> None:
        self._mem = np.arange(64, dtype=np.uint8).reshape(4, 16)

    def to_numpy(self):
        return self._mem.copy()


class SharingHostBuffer(CopyingHostBuffer):
    def to_numpy(self):
        return self._mem[:]


def test_a_device_buffer_that_cannot_be_viewed_zero_copy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"leaf 'full' replica 0 shard 1: a device buffer .*zero-copy.*from_dlpack"):
        streams.zero_copy_view(DeviceBuffer(), "gdskv MAX connector: leaf 'full' replica 0 shard 1")


def test_a_host_buffer_goes_through_numpy_only_when_that_is_a_view():
    with pytest.raises(ValueError, match="to_numpy\\(\\) returns a copy"):
        streams.zero_copy_view(CopyingHostBuffer(), "leaf x")
    buf = SharingHostBuffer()
    view = streams.zero_copy_view(buf, "leaf x")
    view[0, 0] = 200
    assert buf._mem[0, 0] == 200
    t = torch.arange(4, dtype=torch.uint8)
    assert streams.zero_copy_view(t, "leaf x") is t


def test_create_gdskv_connector_refuses_a_device_buffer_it_cannot_view(store_path, monkeypatch):
    monkeypatch.setenv("GDSKV_STORE", store_path)
    monkeypatch.setenv(gmax.ENV_MODEL, "m")
    mem = type("KVCacheMemory", (), {"buffers": [torch.zeros(4, 16, dtype=torch.uint8), DeviceBuffer()], "replicated": False})()
    params = type("Params", (), {"page_size": 16, "dtype": "uint8"})()
    with pytest.raises(ValueError, match=r"leaf 'full' replica 0 shard 1: a device buffer"):
        gmax.create_gdskv_connector({"full": KVCacheGroupId.full()}, [], [{"full": mem}], params, 0)
