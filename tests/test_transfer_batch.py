"""``PageTransfer.save_pages`` / ``load_pages``: a step's pages as one batch on real files. One
future per page, in order; at most ``depth`` pages in flight; the readiness waited on by every
thread that moves a page, before it moves one; a bad or missing chunk is that page's miss only.
Every test runs on the native batch path (``gdskv.io.batch``) and on the per-page Python path."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from cache_helpers import drop_cached
from gdskv import format as fmt
from gdskv.io import batch as batchio
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import FOREGROUND_CALLERS, NATIVE_CALLERS, LoadStatus, LoadVia, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(16 * 24)), 16, "batch")
PAGE = 8192 + 100


@pytest.fixture(autouse=True, params=["native", "per-page"])
def io_path(request, monkeypatch) -> str:
    if request.param == "native" and not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    if request.param == "per-page":
        monkeypatch.setattr(batchio, "_working", False)
    return request.param


def make(store_path: str, depth: int = 3) -> PageTransfer:
    ns = PageStore.open(store_path).namespace(NamespaceSpec("batch/m", "float16", 16, (GroupSpec(0, PAGE, (0,)),)))
    return PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=depth)


def pool(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_batch_round_trips_with_one_future_per_page_in_order(store_path):
    x = make(store_path)
    src, dst = pool(24, 1), torch.zeros(24, PAGE, dtype=torch.uint8)
    saved = x.save_pages(0, [(KEYS[i], KEYS[i - 1] if i else None, [src[i]]) for i in range(24)])
    assert [f.result() for f in saved] == [SaveStatus.PUBLISHED] * 24
    again = x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])
    assert [f.result() for f in again] == [SaveStatus.EXISTS] * 3
    loaded = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(24)])
    assert [f.result() for f in loaded] == [LoadStatus.LOADED] * 24
    assert torch.equal(src, dst)
    x.close()


def test_a_stored_chunk_is_left_as_it_is_and_a_wrong_sized_one_replaced(store_path):
    """Saves of pages stored already are EXISTS and write nothing (the native writer looks for
    the chunk itself); a chunk of the wrong size at the name is no stored page and is replaced."""
    x = make(store_path)
    src = pool(3, 7)
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(2)])] == \
        [SaveStatus.PUBLISHED] * 2
    kept, cut = Path(x.ns.chunk_path(0, KEYS[0])), Path(x.ns.chunk_path(0, KEYS[1]))
    before = kept.stat()
    cut.write_bytes(cut.read_bytes()[:-1])
    got = [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])]
    assert got == [SaveStatus.EXISTS, SaveStatus.PUBLISHED, SaveStatus.PUBLISHED]
    assert (kept.stat().st_ino, kept.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert cut.stat().st_size == x.ns.chunk_nbytes(0)
    assert x.ns.counters["saves_exists"] == 1
    assert not [p for p in Path(x.ns.array_path(0)).rglob("*") if p.is_file() and fmt.TMP_MARK in p.name]
    dst = torch.zeros(3, PAGE, dtype=torch.uint8)
    assert [f.result() for f in x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(3)])] == [LoadStatus.LOADED] * 3
    assert torch.equal(dst, src)
    x.close()


def test_a_missing_or_corrupt_chunk_is_a_miss_of_its_own_page_only(store_path):
    x = make(store_path)
    src, dst = pool(6, 2), torch.zeros(6, PAGE, dtype=torch.uint8)
    [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(5)])]
    path = Path(x.ns.chunk_path(0, KEYS[2]))
    raw = bytearray(path.read_bytes())
    raw[11] ^= 1
    path.write_bytes(bytes(raw))
    got = [f.result() for f in x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(6)])]
    assert got == [LoadStatus.LOADED, LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.LOADED,
                   LoadStatus.LOADED, LoadStatus.MISSING]
    for i in (0, 1, 3, 4):
        assert torch.equal(dst[i], src[i])
    x.close()


class Gate:
    """A readiness that blocks until released and records which threads waited on it."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.waited: set[int] = set()

    def synchronize(self) -> None:
        self.waited.add(threading.get_ident())
        self.open.wait(10)


def test_every_thread_waits_for_readiness_before_it_moves_a_page_and_depth_bounds_the_threads(store_path, monkeypatch):
    x = make(store_path, depth=3)
    src = pool(20, 3)
    [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(20)])]
    movers: set[int] = set()
    active, peak = [0], [0]
    lock = threading.Lock()
    gate = Gate()

    def moving(real, in_flight=lambda *args: 1):
        def move(*args):
            assert gate.open.is_set(), "a page moved before its readiness"
            n = in_flight(*args)
            with lock:
                movers.add(threading.get_ident())
                active[0] += n
                peak[0] = max(peak[0], active[0])
            try:
                time.sleep(0.002)
                return real(*args)
            finally:
                with lock:
                    active[0] -= n
        return move

    monkeypatch.setattr(x.engine, "read_now", moving(x.engine.read_now))
    # a native call moves min(threads, jobs) pages at once on threads of its own
    monkeypatch.setattr(batchio, "read_chunks", moving(batchio.read_chunks, lambda fd, jobs, direct, threads, *staging: min(threads, len(jobs))))
    dst = torch.zeros(20, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(20)], ready=gate)
    time.sleep(0.05)
    assert not any(f.done() for f in futures)
    gate.open.set()
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 20
    assert torch.equal(dst, src)
    assert movers <= gate.waited and 1 <= peak[0] <= 3
    x.close()


def test_a_load_a_step_waits_for_runs_more_native_calls_at_once_than_background_work(store_path, io_path, monkeypatch):
    """``FOREGROUND_CALLERS`` calls share the depth for a load a forward pass waits for (while one
    verifies its slice, the others' pages keep the device busy); an asynchronous load, which runs
    beside the serving thread, takes ``NATIVE_CALLERS``. Either way no more than ``depth`` pages
    move at once."""
    if io_path != "native":
        pytest.skip("native calls are the batch path's own")
    x = make(store_path, depth=16)
    n = 128
    keys = chain_keys(list(range(16 * n)), 16, "callers")
    src = pool(n, 11)
    [f.result() for f in x.save_pages(0, [(keys[i], None, [src[i]]) for i in range(n)])]
    calls, pages, peak_calls, peak_pages = [0], [0], [0], [0]
    lock = threading.Lock()
    real = batchio.read_chunks

    def read_chunks(fd, jobs, direct, threads, *staging):
        with lock:
            calls[0] += 1
            pages[0] += min(threads, len(jobs))
            peak_calls[0], peak_pages[0] = max(peak_calls[0], calls[0]), max(peak_pages[0], pages[0])
        try:
            time.sleep(0.1)  # long enough that every caller's calls overlap, however late it starts
            return real(fd, jobs, direct, threads, *staging)
        finally:
            with lock:
                calls[0] -= 1
                pages[0] -= min(threads, len(jobs))

    monkeypatch.setattr(batchio, "read_chunks", read_chunks)
    ready = Gate()  # a readiness keeps an asynchronous load on the pool threads, as staged pages do
    ready.open.set()
    peaks = {}
    for background in (False, True):
        peak_calls[0] = peak_pages[0] = 0
        dst = torch.zeros(n, PAGE, dtype=torch.uint8)
        futures = x.load_pages(0, [(keys[i], [dst[i]]) for i in range(n)], ready=ready, background=background)
        assert [f.result() for f in futures] == [LoadStatus.LOADED] * n
        assert torch.equal(dst, src)
        assert peak_pages[0] <= 16
        peaks[background] = peak_calls[0]
    assert peaks == {False: FOREGROUND_CALLERS, True: NATIVE_CALLERS} and peaks[False] > peaks[True]
    x.close()


def test_saves_posted_together_get_a_writer_thread_per_share_of_their_bytes(store_path, io_path, monkeypatch):
    """Saves the serving loop posts (``_later``) run beside it: a few pages go to one native
    writer, more to one per share of their bytes up to the depth's share (``writer_threads``),
    and either way every page is published whole."""
    if io_path != "native":
        pytest.skip("native writer threads are the batch path's own")
    from gdskv.transfer import batches

    monkeypatch.setattr(batches, "ONE_WRITER_BYTES", 4 * (PAGE + fmt.TRAILER_BYTES))
    monkeypatch.setattr(batches, "SAVE_BYTES_PER_THREAD", 2 * (PAGE + fmt.TRAILER_BYTES))
    x = make(store_path, depth=8)
    asked: list[tuple[int, int]] = []
    real = x.engine.write_chunks_later

    def write_chunks_later(completions, fd, work, threads, *rest):
        asked.append((len(work), threads))
        return real(completions, fd, work, threads, *rest)

    monkeypatch.setattr(x.engine, "write_chunks_later", write_chunks_later)
    keys = chain_keys(list(range(16 * 40)), 16, "writers")
    src = pool(40, 13)
    for lo, hi in ((0, 3), (3, 9), (9, 40)):
        futures = x.save_pages(0, [(keys[i], None, [src[i]]) for i in range(lo, hi)])
        assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * (hi - lo)
    assert asked == [(3, 1), (6, 3), (31, 8 // NATIVE_CALLERS)]
    dst = torch.zeros(40, PAGE, dtype=torch.uint8)
    assert [f.result() for f in x.load_pages(0, [(keys[i], [dst[i]]) for i in range(40)])] == [LoadStatus.LOADED] * 40
    assert torch.equal(dst, src)
    x.close()


def test_a_cancelled_page_of_a_batch_is_skipped(store_path):
    x = make(store_path, depth=1)
    src = pool(4, 4)
    [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(4)])]
    gate = Gate()
    dst = torch.zeros(4, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(4)], ready=gate)
    assert futures[3].cancel()
    gate.open.set()
    assert [f.result() for f in futures[:3]] == [LoadStatus.LOADED] * 3
    assert futures[3].cancelled() and not dst[3].any()
    x.close()


def test_many_pages_round_trip_with_several_pages_in_flight_per_call(store_path):
    """Depth 8: two callers, each native call moving its slice on four threads of its own."""
    x = make(store_path, depth=8)
    n = 16 * 24
    keys = chain_keys(list(range(16 * n)), 16, "wide")
    src, dst = pool(n, 5), torch.zeros(n, PAGE, dtype=torch.uint8)
    saved = x.save_pages(0, [(keys[i], keys[i - 1] if i else None, [src[i]]) for i in range(n)])
    assert [f.result() for f in saved] == [SaveStatus.PUBLISHED] * n
    loaded = x.load_pages(0, [(keys[i], [dst[i]]) for i in range(n)])
    assert [f.result() for f in loaded] == [LoadStatus.LOADED] * n
    assert torch.equal(src, dst)
    # staging buffers are shared by calls, not kept per thread: no more than ran at once (the
    # saves' callers, then the load's)
    assert x.engine._batch_buffers.qsize() <= max(NATIVE_CALLERS, FOREGROUND_CALLERS)
    x.close()


def test_direct_saves_of_an_unaligned_pool_write_whole_blocks_past_the_page_cache(store_path, io_path):
    """A plain torch pool (rows at no 4 KiB boundary) with ``o_direct``: the chunk's whole blocks
    go out with O_DIRECT (staged), only its last partial block (payload tail and trailer)
    through the page cache, laid out in one extent; the bytes read back exactly."""
    from test_io_engines import _extents, _resident_pages

    x = make(store_path, depth=2)
    src = pool(3, 6)
    assert src[1].data_ptr() % 4096  # unaligned, as torch hands pages over
    for i in range(3):  # a store in service has its chunk directories (a first save makes them)
        os.makedirs(os.path.dirname(x.ns.chunk_path(0, KEYS[i])), exist_ok=True)
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])] == [SaveStatus.PUBLISHED] * 3
    path = x.ns.chunk_path(0, KEYS[1])
    size = os.path.getsize(path)
    assert size == PAGE + 128
    try:
        extents = _extents(path)
    except OSError:
        pytest.skip("this file system has no FIEMAP")
    if io_path == "native":  # the per-page path writes unaligned memory through the page cache
        assert _resident_pages(path) == 1, "whole blocks went through the page cache"
    for (log_a, phys_a, len_a), (log_b, phys_b, _) in zip(extents, extents[1:]):
        assert log_b == log_a + len_a and phys_b == phys_a + len_a, f"chunk split on disk: {extents}"
    dst = torch.zeros(3, PAGE, dtype=torch.uint8)
    assert [f.result() for f in x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(3)])] == [LoadStatus.LOADED] * 3
    assert torch.equal(src, dst)
    x.close()


def test_first_saves_into_a_new_store_make_its_directories_with_the_stores_mode_without_the_per_page_path(
        store_path, io_path, monkeypatch):
    """A new store has none of its chunk directories (4096 per layer group): the native path
    makes each missing one itself, with the store's directory mode whatever the umask, instead of
    sending the page to the per-page path (Python per page) to make it."""
    ns = PageStore.open(store_path, file_mode=0o640, dir_mode=0o750).namespace(
        NamespaceSpec("batch/m", "float16", 16, (GroupSpec(0, PAGE, (0,)),)))
    x = PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=2)
    made = []
    real = ns.store.fs.makedirs
    monkeypatch.setattr(ns.store.fs, "makedirs", lambda path: (made.append(path), real(path))[1])
    old = os.umask(0o077)
    try:
        src = pool(12, 8)
        assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(12)])] == \
            [SaveStatus.PUBLISHED] * 12
    finally:
        os.umask(old)
    dirs = {os.path.dirname(x.ns.chunk_path(0, KEYS[i])) for i in range(12)}
    assert len(dirs) > 1
    for d in dirs:
        assert os.stat(d).st_mode & 0o777 == 0o750
        assert os.stat(os.path.dirname(d)).st_mode & 0o777 == 0o750
    if io_path == "native":
        assert made == [], "pages went to the per-page path to make their directories"
    dst = torch.zeros(12, PAGE, dtype=torch.uint8)
    assert [f.result() for f in x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(12)])] == [LoadStatus.LOADED] * 12
    assert torch.equal(src, dst)
    x.close()


def test_a_link_where_chunk_directories_belong_is_never_followed_to_make_them(store_path, io_path, tmp_path):
    x = make(store_path)
    chunk_dir = os.path.dirname(x.ns.chunk_path(0, KEYS[0]))
    parent = os.path.dirname(chunk_dir)  # .../c/<hi>: its parent .../c made, then a link in its place
    outside = tmp_path / "outside"
    outside.mkdir()
    os.makedirs(os.path.dirname(parent), exist_ok=True)
    os.symlink(outside, parent)
    statuses = [f.result() for f in x.save_pages(0, [(KEYS[0], None, [pool(1, 9)[0]])])]
    assert statuses == [SaveStatus.DROPPED]
    assert list(outside.iterdir()) == []
    x.close()



def test_native_writes_make_every_missing_directory_from_the_deepest_existing_one(tmp_path, io_path):
    """``write_chunks`` with ``dir_mode``: directories missing down from the root itself, from
    a shared parent made by an earlier job, one level deep; each with the mode whatever the
    umask; a link on the way is refused (nothing written through it); an absolute path never
    leaves the root; a missing path with an empty component is EINVAL."""
    import errno

    if io_path != "native":
        pytest.skip("write_chunks is the native batch path's own call")
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "l").mkdir()
    os.symlink(outside, root / "l" / "ink")
    data = torch.arange(100, dtype=torch.uint8)
    piece = [(data.data_ptr(), 100)]
    dirs = ["a/b/c", "a/b/d", "a/x", "z", "l/ink/q", "l/ink", str(outside), "m//n", "p/"]
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    old = os.umask(0o077)
    try:
        errs = batchio.write_chunks(fd, [(d, "t.tmp", "chunk", piece) for d in dirs], 0o640, True, False, False,
                                    threads=1, dir_mode=0o750, dir_chmod=True)
    finally:
        os.umask(old)
        os.close(fd)
    assert errs[:4] == [0, 0, 0, 0]
    assert errs[4] in (errno.ELOOP, errno.EXDEV) and errs[5] in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR)
    assert errs[6:] == [errno.EXDEV, errno.EINVAL, errno.EINVAL]
    for d in dirs[:4]:
        assert (root / d / "chunk").read_bytes() == bytes(range(100))
    for d in ("a", "a/b", "a/b/c", "a/b/d", "a/x", "z"):
        assert os.stat(root / d).st_mode & 0o777 == 0o750, d
    assert list(outside.iterdir()) == []


def test_an_empty_batch_is_no_futures(store_path):
    x = make(store_path)
    assert x.load_pages(0, []) == [] and x.save_pages(0, []) == []
    x.close()


def test_a_load_refreshes_the_mtime_and_leaves_a_lease_in_the_atime_alone(store_path):
    """Recency is the mtime, a lookup's lease the atime set ahead: a load of the chunk (for this
    request or another) moves the first and never shortens the second."""
    x = make(store_path)
    src, dst = pool(1, 7), torch.zeros(1, PAGE, dtype=torch.uint8)
    assert x.save_pages(0, [(KEYS[0], None, [src[0]])])[0].result() is SaveStatus.PUBLISHED
    path = x.ns.chunk_path(0, KEYS[0])
    leased_at = time.time_ns()
    assert x.ns.lease_many(0, [KEYS[0]], 30) == [True]
    lease = os.stat(path).st_atime_ns
    assert lease >= leased_at + 30 * 10**9
    os.utime(path, ns=(lease, leased_at - 10**9))  # last used a second ago
    assert x.load_pages(0, [(KEYS[0], [dst[0]])])[0].result() is LoadStatus.LOADED
    st = os.stat(path)
    assert st.st_atime_ns == lease, "a load cut the lease short"
    assert st.st_mtime_ns >= leased_at, "a load did not refresh the chunk's recency"
    x.close()


def test_a_load_through_a_via_buffer_fills_it_and_the_page_with_the_same_verified_bytes(store_path, io_path):
    """``(key, segments, via)``: the page's two segments and ``via`` both get the chunk's payload
    (cold: O_DIRECT through the staging buffer on the native path; warm: through the page cache,
    into unaligned buffers); a corrupt chunk is a miss either way."""
    from gdskv.io.posix import aligned_host_buffer

    x = make(store_path)
    src = pool(8, 5)
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(8)])] == [SaveStatus.PUBLISHED] * 8
    for i in range(8):  # cold: the O_DIRECT read applies on the native path
        drop_cached(x.ns.chunk_path(0, KEYS[i]))
    raw = bytearray(Path(x.ns.chunk_path(0, KEYS[7])).read_bytes())
    raw[10] ^= 0x40
    Path(x.ns.chunk_path(0, KEYS[7])).write_bytes(bytes(raw))
    vias = torch.frombuffer(aligned_host_buffer(8 * PAGE), dtype=torch.uint8).view(8, PAGE)
    vias.fill_(0xAA)
    halves = [(torch.zeros(PAGE // 2, dtype=torch.uint8), torch.zeros(PAGE - PAGE // 2, dtype=torch.uint8)) for _ in range(8)]
    got = [f.result() for f in x.load_pages(0, [(KEYS[i], list(halves[i]), LoadVia(vias[i])) for i in range(8)])]
    assert got == [LoadStatus.LOADED] * 7 + [LoadStatus.CORRUPT]
    for i in range(7):
        assert torch.equal(vias[i], src[i]) and torch.equal(torch.cat(halves[i]), src[i])
    # warm (each chunk read through the page cache a step at a time), into buffers 3 bytes off
    # any alignment, so the copy-outs start and end mid-line
    for i in range(7):
        Path(x.ns.chunk_path(0, KEYS[i])).read_bytes()
    odd = torch.frombuffer(aligned_host_buffer(7 * PAGE + 3), dtype=torch.uint8)[3:].view(7, PAGE)
    odd.fill_(0x55)
    pages = torch.zeros(7, PAGE, dtype=torch.uint8)
    got = [f.result() for f in x.load_pages(0, [(KEYS[i], [pages[i]], LoadVia(odd[i])) for i in range(7)])]
    assert got == [LoadStatus.LOADED] * 7
    assert torch.equal(odd, src[:7]) and torch.equal(pages, src[:7])
    x.close()


def test_a_via_for_disk_reads_only_is_left_alone_where_the_page_cache_serves_the_chunk(store_path):
    """``LoadVia(buf, cached=False)`` on the native path: a chunk the page cache holds fills the
    page and not ``buf`` (``copied`` False); one read from the disk fills both (``copied`` True);
    ``cached=True`` fills ``buf`` either way."""
    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    x = make(store_path)
    src = pool(3, 8)
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])] == [SaveStatus.PUBLISHED] * 3
    paths = [Path(x.ns.chunk_path(0, KEYS[i])) for i in range(3)]
    for i, path in enumerate(paths):
        drop_cached(path)
        if i != 1:  # chunk 1 only is read from the disk
            path.read_bytes()
    vias = [LoadVia(torch.full((PAGE,), 0xAA, dtype=torch.uint8), cached=i == 2) for i in range(3)]
    pages = torch.zeros(3, PAGE, dtype=torch.uint8)
    got = [f.result() for f in x.load_pages(0, [(KEYS[i], [pages[i]], vias[i]) for i in range(3)])]
    assert got == [LoadStatus.LOADED] * 3 and torch.equal(pages, src)
    assert [v.copied for v in vias] == [False, True, True]
    assert bool((vias[0].buf == 0xAA).all())
    assert torch.equal(vias[1].buf, src[1]) and torch.equal(vias[2].buf, src[2])
    x.close()


def test_copy_out_pieces_must_add_up_to_the_payload(store_path, io_path):
    if io_path != "native":
        pytest.skip("copy-out pieces are an argument of the native batch path only")
    x = make(store_path)
    src = pool(1, 6)
    x.save_pages(0, [(KEYS[0], None, [src[0]])])[0].result()
    trailer = bytearray(128)
    dst, out = torch.zeros(PAGE, dtype=torch.uint8), torch.zeros(PAGE - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="add up"):
        batchio.read_chunks(x.ns.store.fs.fd, [(x.ns.chunk_relpath(0, KEYS[0]), batchio.pieces_of([dst], trailer),
                                                [(out.data_ptr(), PAGE - 1)])], False)
    x.close()


def test_a_trailer_is_verified_natively_only_where_the_python_check_accepts_it(store_path, io_path):
    """The native read verifies a chunk's trailer itself (``expect``) and the Python check is
    skipped for the chunks it verified: so it must never verify one that ``check_crc`` refuses.
    Each trailer below is well formed (its own checksum right) but says something else."""
    if io_path != "native":
        pytest.skip("trailer verification is part of the native batch path only")
    import dataclasses

    from gdskv import checksum
    from gdskv import format as fmt

    x = make(store_path)
    src = pool(1, 10)[0]
    key, ns = KEYS[0], x.ns
    assert x.save_pages(0, [(key, None, [src])])[0].result() is SaveStatus.PUBLISHED
    path, fd = ns.chunk_path(0, key), ns.store.fs.fd
    with open(path, "rb") as f:
        payload, good = f.read(PAGE), fmt.unpack(f.read())
    crc, skey = fmt.crc32c(payload), ns.store_key(0, key)
    assert good.payload_crc == crc and good.store_key == skey
    other = bytes(32 - i for i in range(32))
    variants = {
        "as saved": good,
        "with a parent": dataclasses.replace(good, parent_key=KEYS[1]),
        "another group": dataclasses.replace(good, layer_group=1),
        "another length": dataclasses.replace(good, payload_nbytes=PAGE - 1),
        "another store key": dataclasses.replace(good, store_key=other),
        "another block key": dataclasses.replace(good, block_key=other),
        "a short block key": dataclasses.replace(good, block_key=key[:8]),
        "another checksum": dataclasses.replace(good, payload_crc=crc ^ 1),
        "a checksum past 32 bits": dataclasses.replace(good, payload_crc=crc | 1 << 32),
        "the device checksum": dataclasses.replace(good, checksum_algo=fmt.CHECKSUM_POLY),
        "a MAC": dataclasses.replace(good, store_key=None, mac=other),
        "version 1": dataclasses.replace(good, version=1),
    }
    raw = {name: fmt.pack(t) for name, t in variants.items()}

    def edited(at: int, value: int) -> bytes:  # one byte changed, the trailer's own checksum made right again
        b = bytearray(raw["as saved"])
        b[at] |= value
        b[20:24] = bytes(4)
        b[20:24] = fmt.crc32c(bytes(b)).to_bytes(4, "little")
        return bytes(b)

    raw["non-zero padding"] = edited(127, 1)
    raw["a reserved flag"] = edited(10, 0x20)
    raw["the MAC flag over the store key"] = edited(10, fmt.FLAG_AUTHENTICATED)
    verdicts = {}
    for name, trailer_bytes in raw.items():
        with open(path, "wb") as f:
            f.write(payload + trailer_bytes)
        dst, trailer = torch.zeros(PAGE, dtype=torch.uint8), bytearray(128)
        expect = batchio.expectation(0, PAGE, skey, key)
        [result] = batchio.read_chunks(fd, [(ns.chunk_relpath(0, key), batchio.pieces_of([dst], trailer), None, expect)],
                                       False)
        assert result.err == 0 and result.crc == crc
        python_says = checksum.check_crc(trailer, [dst], result.crc, group=0, store_key=skey, block_key=key, nbytes=PAGE)
        verdicts[name] = (result.verified, python_says)
    assert verdicts["as saved"] == (True, None) and verdicts["with a parent"] == (True, None)
    assert verdicts["version 1"] == (False, None)  # a legacy chunk is the Python check's to accept
    for name, (verified, python_says) in verdicts.items():
        if name not in ("as saved", "with a parent", "version 1"):
            assert python_says is not None and not verified, (name, python_says)
    x.close()


def test_a_chunk_read_from_the_page_cache_a_step_at_a_time_is_whole_and_verified(store_path, io_path):
    """Chunks in the page cache are read a step (256 KiB) at a time on the native path, each step
    checksummed and copied into ``via`` while in cache: pages of several uneven segments that
    cross step boundaries come back whole in both, and a byte flipped in a late step is a miss."""
    big = 3 * (256 << 10) + 1000
    cuts = [5, 300 << 10, 7, 200 << 10]
    ns = PageStore.open(store_path).namespace(NamespaceSpec("batch/big", "float16", 16, (GroupSpec(0, big, (0,)),)))
    x = PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=3)
    src = torch.randint(0, 256, (4, big), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(4)])] == [SaveStatus.PUBLISHED] * 4
    path = Path(ns.chunk_path(0, KEYS[3]))
    raw = bytearray(path.read_bytes())
    raw[big - 10] ^= 0x01
    path.write_bytes(bytes(raw))
    for i in range(3):  # saved with O_DIRECT: read once through the page cache, as chunk 3 was written
        Path(ns.chunk_path(0, KEYS[i])).read_bytes()
    pages = torch.zeros(4, big, dtype=torch.uint8)
    vias = torch.full((4, big), 0xAA, dtype=torch.uint8)
    bounds = [0, *torch.tensor(cuts).cumsum(0).tolist(), big]
    segments = [[pages[i][a:b] for a, b in zip(bounds, bounds[1:])] for i in range(4)]
    got = [f.result() for f in x.load_pages(0, [(KEYS[i], segments[i], LoadVia(vias[i])) for i in range(4)])]
    assert got == [LoadStatus.LOADED] * 3 + [LoadStatus.CORRUPT]
    for i in range(3):
        assert torch.equal(pages[i], src[i]) and torch.equal(vias[i], src[i])
    x.close()


def _dio_mem_align(path: Path) -> int:
    """The memory alignment ``statx`` says the file's file system asks of O_DIRECT buffers, or 0
    where the kernel does not say (read by offset, as ``_batchio.c`` does)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    if libc.syscall(332, -100, str(path).encode(), 0, 0x2000, buf) != 0:  # SYS_statx, AT_FDCWD, STATX_DIOALIGN
        return 0
    mask, mem, offset = (int.from_bytes(buf.raw[a:a + 4], "little") for a in (0, 152, 156))
    return mem if mask & 0x2000 and offset else 0


def test_pages_at_an_address_the_file_systems_direct_io_takes_move_in_place_not_through_staging(tmp_path, io_path):
    """Direct I/O asks the address alignment the file system reports (statx STATX_DIOALIGN: 4
    bytes on NVMe, where torch's own tensors qualify; 512 on virtio disks), not a page boundary:
    a page at such an address is written and read back with O_DIRECT in place, and only the
    trailer passes through the staging buffer; a page at half that alignment is staged both
    ways. Both read back exactly."""
    if io_path != "native":
        pytest.skip("read_chunks/write_chunks are the native batch path's own calls")
    if os.uname().machine != "x86_64":
        pytest.skip("the test calls statx by its x86-64 system call number")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    mem = _dio_mem_align(probe)
    if not 1 < mem < 4096:
        pytest.skip(f"this file system reports no direct-I/O alignment finer than a page ({mem})")
    page, trailer = 64 * 1024, 128
    arena = torch.frombuffer(bytearray(4 * page + 8192), dtype=torch.uint8)
    start = -arena.data_ptr() % 4096
    payload = torch.randint(0, 256, (page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    tail = torch.arange(trailer, dtype=torch.uint8)
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for offset, in_place in ((mem, True), (mem // 2, False)):
            src = arena[start + offset:start + offset + page]
            src.copy_(payload)
            need = batchio.staging_need([page + trailer], 1)
            staging = torch.frombuffer(bytearray(need + 4096), dtype=torch.uint8)
            staging = staging[-staging.data_ptr() % 4096:][:need]
            staging.fill_(0xEE)
            name = f"c{offset}"
            errs = batchio.write_chunks(fd, [("d", f"{name}.tmp", name, [(src.data_ptr(), page),
                                                                            (tail.data_ptr(), trailer)])],
                                        0o644, False, False, True, 1, (staging.data_ptr(), need), dir_mode=0o755)
            assert errs == [0]
            assert (root / "d" / name).read_bytes() == payload.numpy().tobytes() + tail.numpy().tobytes()
            assert bool((staging == 0xEE).all()) == in_place, f"+{offset}: staged {not in_place} expected"
            dst = arena[start + 2 * page + offset:start + 2 * page + offset + page]
            dst.zero_()
            back = torch.zeros(trailer, dtype=torch.uint8)
            drop_cached(root / "d" / name)
            staging.fill_(0xEE)
            res = batchio.read_chunks(fd, [(f"d/{name}", [(dst.data_ptr(), page), (back.data_ptr(), trailer)])],
                                      True, 1, (staging.data_ptr(), need))
            assert res[0].err == 0
            assert torch.equal(dst, payload) and torch.equal(back, tail)
            assert bool((staging[4096:] == 0xEE).all()) == in_place, f"+{offset}: read staged {not in_place} expected"
    finally:
        os.close(fd)


def test_a_saved_pages_via_buffer_holds_exactly_what_was_published(store_path, io_path):
    """``save_pages`` items with a ``via`` buffer (the host tier's): once PUBLISHED it holds the
    page's payload (natively: copied in the pass that seals the page), the chunk reads back as
    the same bytes; a page already stored leaves its buffer untouched; a buffer of the wrong
    size is refused before anything is written."""
    x = make(store_path)
    src = pool(4, 12)
    assert x.save_pages(0, [(KEYS[0], None, [src[0]])])[0].result() is SaveStatus.PUBLISHED
    vias = [torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in range(4)]
    got = [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i, :100], src[i, 100:]], vias[i]) for i in range(4)])]
    assert got == [SaveStatus.EXISTS] + [SaveStatus.PUBLISHED] * 3
    assert bool((vias[0] == 0xEE).all())
    assert all(torch.equal(vias[i], src[i]) for i in range(1, 4))
    dst = torch.zeros(4, PAGE, dtype=torch.uint8)
    assert [f.result() for f in x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(4)])] == [LoadStatus.LOADED] * 4
    assert torch.equal(dst, src)
    wrong = x.save_pages(0, [(KEYS[5], None, [src[0]], torch.zeros(PAGE - 1, dtype=torch.uint8))])[0]
    with pytest.raises(ValueError, match="via buffer"):
        wrong.result()
    assert not os.path.exists(x.ns.chunk_path(0, KEYS[5]))
    if io_path == "native":
        root = os.open(store_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(ValueError, match="add up to the payload"):
                batchio.write_chunks(root, [("d", "t.tmp", "c", [(src[0].data_ptr(), PAGE), (src[1].data_ptr(), 128)],
                                             False, [(vias[0].data_ptr(), PAGE - 1)])], 0o644, False, False, False)
            assert not os.path.exists(os.path.join(store_path, "d"))
        finally:
            os.close(root)
    x.close()
