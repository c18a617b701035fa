"""Asynchronous loads finished by the serving loop: ``PageTransfer.load_pages(background=True)``
on the native path starts the reads on native threads (``_batchio.Completions``) and returns;
``reap`` (the serving loop, between steps) verifies, counts and resolves them on the caller's
thread, so no Python thread needs the interpreter while pages move; loads nobody reaps are
finished by the reaper thread ``REAP_GRACE`` later. Real chunk files, real threads."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from gdskv.io import batch as batchio
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import later as transfer_later
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(16 * 40)), 16, "later")
PAGE = 3 * 4096 + 64

pytestmark = pytest.mark.skipif(not batchio.available(), reason="the native batch path (gdskv.io._batchio) is not built")


def make(store_path: str, nice: int = 5) -> PageTransfer:
    ns = PageStore.open(store_path).namespace(NamespaceSpec("later/m", "float16", 16, (GroupSpec(0, PAGE, (0,)),)))
    return PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=4, background_nice=nice)


def saved(x: PageTransfer, n: int, seed: int = 1) -> torch.Tensor:
    src = torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    assert [f.result(timeout=30) for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(n)])] == \
        [SaveStatus.PUBLISHED] * n
    return src


def wait_reaping(x: PageTransfer, futures: list, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "the loads never finished"
        x.reap()
        time.sleep(0.001)


def test_a_background_load_is_finished_on_the_thread_that_reaps_it(store_path):
    x = make(store_path)
    src = saved(x, 24)
    dst = torch.zeros(24, PAGE, dtype=torch.uint8)
    threads: set[int] = set()

    def on_done(done, results, skipped):
        threads.add(threading.get_ident())

    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(24)], on_done=on_done, background=True)
    for f in futures:
        f.add_done_callback(lambda _: threads.add(threading.get_ident()))
    wait_reaping(x, futures)
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 24
    assert torch.equal(dst, src)
    assert threads == {threading.get_ident()}  # bookkeeping and callbacks on the reaping thread only
    assert x.ns.counters.snapshot()["loads_hit"] == 24
    x.close()


def test_a_background_load_nobody_reaps_finishes_by_itself_after_the_grace(store_path, monkeypatch):
    monkeypatch.setattr(transfer_later, "REAP_GRACE", 0.3)
    x = make(store_path)
    src = saved(x, 8)
    dst = torch.zeros(8, PAGE, dtype=torch.uint8)
    t0 = time.monotonic()
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(8)], background=True)
    while not all(f.done() for f in futures):  # looked at, never reaped nor waited for
        assert time.monotonic() - t0 < 10
        time.sleep(0.005)
    assert time.monotonic() - t0 >= 0.3  # left to the serving loop that long first
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 8 and torch.equal(dst, src)
    x.close()


def test_a_caller_blocked_on_a_result_does_not_wait_out_the_grace(store_path, monkeypatch):
    monkeypatch.setattr(transfer_later, "REAP_GRACE", 3600.0)
    x = make(store_path)
    src = saved(x, 8)  # the saves' results are waited for too
    dst = torch.zeros(8, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(8)], background=True)
    assert [f.result(timeout=30) for f in futures] == [LoadStatus.LOADED] * 8
    assert torch.equal(dst, src)
    x.close()


def test_corrupt_and_missing_chunks_of_a_background_load_are_misses_of_their_own_pages(store_path):
    x = make(store_path)
    src = saved(x, 6)
    path = Path(x.ns.chunk_path(0, KEYS[2]))
    raw = bytearray(path.read_bytes())
    raw[5] ^= 1
    path.write_bytes(bytes(raw))
    dst = torch.zeros(8, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(8)], background=True)
    wait_reaping(x, futures)
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 2 + [LoadStatus.CORRUPT] + [LoadStatus.LOADED] * 3 \
        + [LoadStatus.MISSING] * 2
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(dst[i], src[i])
    assert not path.exists()  # quarantined
    x.close()


def test_close_waits_for_background_loads_in_flight_and_finishes_them(store_path):
    x = make(store_path)
    src = saved(x, 32)
    dst = torch.zeros(32, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(32)], background=True)
    x.close()
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 32
    assert torch.equal(dst, src)
    assert not any(t.name == "gdskv-xfer-reap" and t.is_alive() for t in threading.enumerate())


def test_completions_hand_each_call_back_once_with_its_tag_and_wake_for_the_overdue(store_path):
    x = make(store_path)
    src = saved(x, 4)
    dst = torch.zeros(4, PAGE, dtype=torch.uint8)
    ns, engine = x.ns, x.engine
    queue = batchio.completions()
    trailers = [bytearray(128) for _ in range(4)]
    jobs = [(ns.chunk_relpath(0, KEYS[i]), batchio.pieces_of([dst[i]], trailers[i])) for i in range(4)]
    engine.read_chunks_later(queue, ns.store.fs.fd, jobs[:2], 2, 0, "first")
    engine.read_chunks_later(queue, ns.store.fs.fd, jobs[2:], 1, 0, "second")
    got: dict = {}
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        for tag, results in engine.collect_done(queue):
            assert tag not in got
            got[tag] = results
    assert sorted(got) == ["first", "second"]
    assert [r.err for r in got["first"] + got["second"]] == [0] * 4
    assert torch.equal(dst, src) and engine.collect_done(queue) == []
    assert queue.running() == 0
    assert not queue.wait_overdue(0.01, 0.05)  # nothing uncollected: the timeout
    engine.read_chunks_later(queue, ns.store.fs.fd, jobs[:1], 1, 0, "late")
    t0 = time.monotonic()
    assert queue.wait_overdue(0.05, 10.0)  # finished and left uncollected for the grace
    assert time.monotonic() - t0 >= 0.05
    assert [tag for tag, _ in engine.collect_done(queue)] == ["late"]
    waiter = threading.Thread(target=lambda: got.update(closed=queue.wait_overdue(0.01, 30.0)))
    waiter.start()
    queue.close()
    waiter.join(5)
    assert not waiter.is_alive() and got["closed"] is False
    x.close()


def test_copies_later_are_handed_back_once_with_their_tag_and_the_bytes_in_place():
    src = torch.randint(0, 256, (3, 3 << 20), dtype=torch.uint8)  # 3 MiB each: several pieces
    dst = torch.zeros_like(src)
    queue = batchio.completions()
    batchio.copy_later(queue, [(dst[i].data_ptr(), src[i].data_ptr(), src[i].numel()) for i in range(2)], 2, 0, "two")
    batchio.copy_later(queue, [(dst[2].data_ptr(), src[2].data_ptr(), src[2].numel())], 1, 0, "one")
    assert queue.wait_idle(10.0)
    assert sorted(batchio.collect(queue)) == [("one", None), ("two", None)]
    assert batchio.collect(queue) == [] and torch.equal(dst, src)
    with pytest.raises(TypeError):
        batchio.copy_later(queue, [(1, 2)], 1, 0, "bad")
    assert queue.running() == 0 and batchio.collect(queue) == []


def test_the_native_threads_of_a_background_load_run_niced(store_path, monkeypatch):
    x = make(store_path, nice=7)
    saved(x, 2)
    dst = torch.zeros(2, PAGE, dtype=torch.uint8)
    seen: list[int] = []
    real = batchio.read_later

    def spy(queue, root_fd, jobs, direct, threads, staging, nice, tag):
        seen.append(nice)
        return real(queue, root_fd, jobs, direct, threads, staging, nice, tag)

    monkeypatch.setattr(batchio, "read_later", spy)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(2)], background=True)
    wait_reaping(x, futures)
    assert seen == [7]
    x.close()


def test_saves_are_sealed_natively_exactly_as_python_seals_them_and_finished_by_the_reaping_thread(store_path):
    from gdskv import checksum
    from gdskv import format as fmt

    x = make(store_path)
    src = torch.randint(0, 256, (6, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    threads: set[int] = set()
    futures = x.save_pages(0, [(KEYS[i], KEYS[i - 1] if i else None, [src[i]]) for i in range(6)],
                           on_done=lambda done, results, skipped: threads.add(threading.get_ident()))
    wait_reaping(x, futures)
    assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 6
    assert threads == {threading.get_ident()}
    for i in range(6):
        raw = Path(x.ns.chunk_path(0, KEYS[i])).read_bytes()
        assert raw[:PAGE] == bytes(src[i].numpy())
        assert raw[PAGE:] == checksum.seal([src[i]], group=0, store_key=x.ns.store_key(0, KEYS[i]), block_key=KEYS[i],
                                           parent_key=KEYS[i - 1] if i else None, algo=fmt.CHECKSUM_CRC32C)
    again = x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(2)])
    assert [f.result() for f in again] == [SaveStatus.EXISTS] * 2
    x.close()


@pytest.mark.parametrize("nbytes", [3 * 4096 + 64, 3 * 4096 - 64, 2 * 4096, 100])
@pytest.mark.parametrize("aligned", [False, True], ids=["torch", "aligned"])
def test_a_save_staged_for_o_direct_is_sealed_in_that_pass_exactly_as_python_seals_it(store_path, nbytes, aligned):
    """Payload ends past the last whole block, the trailer straddling it, a block-aligned payload,
    no whole block at all; pages in plain torch memory (staged) and in aligned memory (written in
    place), each page as two segments: every chunk byte-identical to Python's, and loads back."""
    from gdskv import checksum
    from gdskv import format as fmt
    from gdskv.bench import page_pool

    ns = PageStore.open(store_path).namespace(NamespaceSpec(f"later/{nbytes}", "uint8", 16, (GroupSpec(0, nbytes, (0,)),)))
    x = PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=4, background_nice=0)
    pool = page_pool(4, nbytes, "hugepage") if aligned else torch.empty(4, nbytes, dtype=torch.uint8)
    pool.copy_(torch.randint(0, 256, (4, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)))
    half = nbytes // 2
    futures = x.save_pages(0, [(KEYS[i], KEYS[i - 1] if i else None, [pool[i, :half], pool[i, half:]]) for i in range(4)])
    wait_reaping(x, futures)
    assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 4
    for i in range(4):
        raw = Path(ns.chunk_path(0, KEYS[i])).read_bytes()
        assert raw[:nbytes] == bytes(pool[i].numpy())
        assert raw[nbytes:] == checksum.seal([pool[i]], group=0, store_key=ns.store_key(0, KEYS[i]), block_key=KEYS[i],
                                             parent_key=KEYS[i - 1] if i else None, algo=fmt.CHECKSUM_CRC32C)
    back = torch.zeros(4, nbytes, dtype=torch.uint8)
    assert [f.result(timeout=30) for f in x.load_pages(0, [(KEYS[i], [back[i]]) for i in range(4)])] == [LoadStatus.LOADED] * 4
    assert torch.equal(back, pool)
    x.close()


def test_authenticated_saves_carry_their_mac_and_load_back(store_path):
    ns = PageStore.open(store_path).namespace(NamespaceSpec("later/m", "float16", 16, (GroupSpec(0, PAGE, (0,)),)))
    key = b"k" * 32
    x = PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=4, background_nice=5, auth_key=key)
    src = torch.randint(0, 256, (4, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    assert [f.result() for f in x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(4)])] == \
        [SaveStatus.PUBLISHED] * 4
    dst = torch.zeros(4, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(4)], background=True)
    assert [f.result() for f in futures] == [LoadStatus.LOADED] * 4 and torch.equal(dst, src)
    x.close()
    other = PageTransfer(ns, PosixEngine(threads=1, o_direct=True), threads=4, background_nice=5)  # no key: refused
    futures = other.load_pages(0, [(KEYS[0], [dst[0]])], background=True)
    assert futures[0].result() is LoadStatus.CORRUPT
    other.close()


def test_a_save_whose_native_write_fails_is_redone_and_what_was_in_the_way_quarantined(store_path):
    x = make(store_path)
    src = torch.randint(0, 256, (3, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    in_the_way = Path(x.ns.chunk_path(0, KEYS[1]))
    in_the_way.mkdir(parents=True)
    (in_the_way / "f").write_bytes(b"x")
    futures = x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])
    assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * 3
    assert in_the_way.is_file() and in_the_way.read_bytes()[:PAGE] == bytes(src[1].numpy())
    x.close()


def test_transfers_that_cannot_start_natively_are_redone_and_none_is_taken_after_close(store_path, monkeypatch):
    x = make(store_path)
    src = torch.randint(0, 256, (3, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))

    def refuse(*args, **kwargs):
        raise OSError("no threads left")

    monkeypatch.setattr(x.engine, "write_chunks_later", refuse)
    monkeypatch.setattr(x.engine, "read_chunks_later", refuse)
    futures = x.save_pages(0, [(KEYS[i], None, [src[i]]) for i in range(3)])
    assert [f.result(timeout=30) for f in futures] == [SaveStatus.PUBLISHED] * 3
    dst = torch.zeros(3, PAGE, dtype=torch.uint8)
    futures = x.load_pages(0, [(KEYS[i], [dst[i]]) for i in range(3)], background=True)
    assert [f.result(timeout=30) for f in futures] == [LoadStatus.LOADED] * 3 and torch.equal(dst, src)
    monkeypatch.undo()
    x.close()
    with pytest.raises(RuntimeError):  # refused, never left pending with no one to finish it
        x.save_pages(0, [(KEYS[5], None, [src[0]])])
