"""``PageTransfer`` on real files: pages staged through a host buffer (what device pages get
when the engine has no GDS: issue 10, the device checksum computed on the host copy that exists
anyway) round-trip, carry CRC32C, and a staged load touches the page only once verified; a
step's staged pages go through the native batch path a span of one shared buffer at a time
(``SliceStaging``), as CUDA pages do on a GPU machine without GDS (``scripts/gpu_check.py``
runs that with device memory)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from gdskv import format as fmt
from gdskv.transfer import core as transfer_core
from gdskv.io import batch as batchio
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.staging import SliceStaging
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(16 * 8)), 16, "transfer")
SIZES = [4096 + 100, 3000]


def pages(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]


def transfer(store_path: str, **kw) -> PageTransfer:
    ns = PageStore.open(store_path).namespace(NamespaceSpec("transfer/m", "float16", 16, (GroupSpec(0, sum(SIZES), (0,)),)))
    return PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=2, **kw)


def test_a_staged_page_round_trips_and_is_checksummed_with_crc32c_on_the_host_copy(store_path):
    x = transfer(store_path, stage_host=True)
    src = pages(1)
    assert x.save_page(0, KEYS[0], None, src).result() is SaveStatus.PUBLISHED
    raw = Path(x.ns.chunk_path(0, KEYS[0])).read_bytes()
    assert fmt.unpack(raw[-fmt.TRAILER_BYTES:]).checksum_algo == fmt.CHECKSUM_CRC32C
    dst = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    assert x.load_page(0, KEYS[0], dst).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    plain = transfer(store_path)  # an unstaged reader reads what a staged writer wrote
    dst2 = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    assert plain.load_page(0, KEYS[0], dst2).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst2))
    x.close()
    plain.close()


def test_a_corrupt_chunk_never_reaches_a_staged_page(store_path):
    x = transfer(store_path, stage_host=True)
    x.save_page(0, KEYS[1], KEYS[0], pages(2)).result()
    path = Path(x.ns.chunk_path(0, KEYS[1]))
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x40
    path.write_bytes(bytes(raw))
    dst = [torch.full((n,), 0xAB, dtype=torch.uint8) for n in SIZES]
    assert x.load_page(0, KEYS[1], dst).result() is LoadStatus.CORRUPT
    assert all((d == 0xAB).all() for d in dst)  # untouched: the bad bytes stayed in the staging buffer
    x.close()


def test_pages_of_different_sizes_share_one_growing_staging_buffer(store_path):
    x = transfer(store_path, stage_host=True)
    small = x._staged([torch.zeros(10, dtype=torch.uint8)])
    big = x._staged([torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)])
    assert [v.numel() for v in small] == [10] and [v.numel() for v in big] == [1 << 20, 5]
    assert x._staged([torch.zeros(3, dtype=torch.uint8)])[0].data_ptr() == big[0].data_ptr()
    assert transfer(store_path)._staged(pages(0)) is None  # host pages, no GDS question: not staged
    x.close()


class _Spy:
    """Counts the pages a module function of ``gdskv.transfer`` is called with (from any transfer
    thread), then calls it."""

    def __init__(self, fn):
        self.fn, self.pages, self._lock = fn, 0, threading.Lock()

    def __call__(self, pairs, *args):
        with self._lock:
            self.pages += len(pairs)
        return self.fn(pairs, *args)


@pytest.fixture
def staged_native(store_path, monkeypatch):
    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    x = transfer(store_path, stage_host=True)
    x._slice_staging.limit = 16 << 10  # two 7 KiB pages per span: a step takes several spans

    def per_page(segments):
        raise AssertionError("a staged slice went to the per-page path")

    monkeypatch.setattr(x, "_staged", per_page)
    gathered, scattered = _Spy(transfer_core.gather_all), _Spy(transfer_core.scatter_all)
    monkeypatch.setattr(transfer_core, "gather_all", gathered)
    monkeypatch.setattr(transfer_core, "scatter_all", scattered)
    yield x, gathered, scattered
    x.close()


def test_a_step_of_staged_pages_goes_natively_through_one_buffer_span_by_span(staged_native):
    x, gathered, scattered = staged_native
    src = [pages(10 + i) for i in range(7)]
    saved = x.save_pages(0, [(KEYS[i], KEYS[i - 1] if i else None, src[i]) for i in range(7)], ready=_Ready())
    assert [f.result() for f in saved] == [SaveStatus.PUBLISHED] * 7
    assert gathered.pages == 7
    for i in range(7):
        raw = Path(x.ns.chunk_path(0, KEYS[i])).read_bytes()
        assert fmt.unpack(raw[-fmt.TRAILER_BYTES:]).checksum_algo == fmt.CHECKSUM_CRC32C
        assert raw[:len(raw) - fmt.TRAILER_BYTES] == b"".join(t.numpy().tobytes() for t in src[i])
    dst = [[torch.zeros(n, dtype=torch.uint8) for n in SIZES] for _ in range(7)]
    loaded = x.load_pages(0, [(KEYS[i], dst[i]) for i in range(7)])
    assert [f.result() for f in loaded] == [LoadStatus.LOADED] * 7
    assert scattered.pages == 7
    assert all(torch.equal(a, b) for i in range(7) for a, b in zip(src[i], dst[i]))


def test_a_corrupt_chunk_in_a_staged_step_is_that_pages_miss_and_never_reaches_it(staged_native, monkeypatch):
    x, _, scattered = staged_native
    src = [pages(20 + i) for i in range(4)]
    assert all(f.result() is SaveStatus.PUBLISHED for f in x.save_pages(0, [(KEYS[i], None, src[i]) for i in range(4)]))
    path = Path(x.ns.chunk_path(0, KEYS[2]))
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0x01
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(x, "_staged", lambda segments: None)  # the bad page's retry reads into the span
    dst = [[torch.full((n,), 0xAB, dtype=torch.uint8) for n in SIZES] for _ in range(4)]
    results = [f.result() for f in x.load_pages(0, [(KEYS[i], dst[i]) for i in range(4)])]
    assert results == [LoadStatus.LOADED, LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.LOADED]
    assert scattered.pages == 3
    assert all((d == 0xAB).all() for d in dst[2])
    assert all(torch.equal(a, b) for i in (0, 1, 3) for a, b in zip(src[i], dst[i]))


def test_slice_staging_spans_fit_the_limit_and_pages_start_on_4k_boundaries():
    staging = SliceStaging(limit=16 << 10)
    assert staging.spans([7196, 7196, 7196, 7196, 7196]) == [range(0, 2), range(2, 4), range(4, 5)]
    assert staging.spans([40_000, 100, 0, 0, 100]) == [range(0, 1), range(1, 5)]  # an oversized page alone
    assert staging.spans([]) == []
    assert staging.spans([40_000, 0, 0]) == [range(0, 1), range(1, 3)]
    with staging.carved([None, None]) as nothing:  # a span with no page to stage borrows no buffer
        assert nothing == [None, None] and staging._free == []
    a, b = [torch.zeros(100, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8)], [torch.zeros(7, dtype=torch.uint8)]
    with staging.carved([a, None, b]) as carved:
        assert carved[1] is None
        (flat_a, views_a), (flat_b, views_b) = carved[0], carved[2]
        assert [v.numel() for v in views_a] == [100, 5000] and flat_a.numel() == 5100 and views_b[0].numel() == 7
        assert views_a[1].data_ptr() == views_a[0].data_ptr() + 100  # regions end to end, as in the chunk
        assert flat_a.data_ptr() % 4096 == 0 and flat_b.data_ptr() - flat_a.data_ptr() == 8192
        with staging.carved([b]) as meanwhile:  # a span moving at the same time gets a buffer of its own
            assert meanwhile[0][0].data_ptr() != flat_a.data_ptr()
    with staging.carved([b]) as later:
        assert later[0][0].data_ptr() in (flat_a.data_ptr(), meanwhile[0][0].data_ptr())  # buffers go back, reused
    assert len(staging._free) == 2


class _Ready:
    """A readiness (what a CUDA event is to ``save_pages``): the step goes to the transfer threads."""

    def synchronize(self) -> None:
        pass
