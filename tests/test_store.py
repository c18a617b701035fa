"""The store on real files: round trips, atomic publish under SIGKILL, every kind of bad chunk
is a miss (counted, quarantined), namespaces isolate, plain zarr reads it, a full disk drops saves."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from gdskv import format as fmt
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore, StoreError
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(64)), 16, "t")


def spec(page=4096 + 1000, model="m", dtype="float16", tp_rank=0, groups=1):
    return NamespaceSpec(model, dtype, 16, tuple(GroupSpec(g, page, (g,), None if g == 0 else 64) for g in range(groups)), tp_rank=tp_rank, tp_size=2 if tp_rank else 1)


@pytest.fixture
def xfer(store_path):
    engine = PosixEngine(threads=4)
    t = PageTransfer(PageStore.open(store_path).namespace(spec()), engine, threads=4)
    yield t
    t.close()
    engine.close()


def rand_page(n, seed):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sizes", [[4096], [1 << 20], [4 << 20], [4096 + 128, 1000], [3, 70001, 4096]])
def test_round_trip_of_pages_and_regions(store_path, sizes):
    ns = PageStore.open(store_path).namespace(spec(page=sum(sizes)))
    engine = PosixEngine()
    x = PageTransfer(ns, engine)
    src = [rand_page(n, i) for i, n in enumerate(sizes)]
    assert x.save_page(0, KEYS[0], None, src).result() is SaveStatus.PUBLISHED
    assert x.save_page(0, KEYS[0], None, src).result() is SaveStatus.EXISTS
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    assert x.load_page(0, KEYS[0], dst).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert x.load_page(0, KEYS[1], dst).result() is LoadStatus.MISSING
    c = ns.counters.snapshot()
    assert (c["saves_published"], c["saves_exists"], c["loads_hit"], c["loads_missing"]) == (1, 1, 1, 1)
    x.close()
    engine.close()


def test_page_of_the_wrong_size_is_a_programming_error(xfer):
    with pytest.raises(ValueError, match="expects"):
        xfer.save_page(0, KEYS[0], None, [torch.zeros(10, dtype=torch.uint8)]).result()


def test_plain_zarr_reads_the_store(xfer, store_path):
    page = rand_page(5096, 7)
    xfer.save_page(0, KEYS[2], KEYS[1], [page]).result()
    root = zarr.open(store_path, mode="r")
    arr = root[f"ns/{xfer.ns.id}/g0"]
    hi, lo = fmt.chunk_index(xfer.ns.store_key(0, KEYS[2]))
    assert np.array_equal(arr[hi, :5096, lo], page.numpy())
    assert root[f"ns/{xfer.ns.id}"].attrs["gdskv_namespace"]["model"] == "m"
    trailer = fmt.unpack(arr[hi, 5096:, lo].tobytes())
    assert (trailer.block_key, trailer.parent_key, trailer.payload_nbytes) == (KEYS[2], KEYS[1], 5096)


def test_contains_many_batches(xfer):
    for i in (0, 2, 3):
        xfer.save_page(0, KEYS[i], None, [rand_page(5096, i)]).result()
    assert xfer.ns.contains_many(0, KEYS) == [True, False, True, True]


def test_store_key_run_is_every_store_key_in_order(xfer):
    ns = xfer.ns
    keys = KEYS + [b"\x05" * 8, bytearray(KEYS[0])]
    one_by_one = b"".join(ns.store_key(0, bytes(k)) for k in keys)
    assert ns.store_key_run(0, keys) == one_by_one
    assert ns.store_key_run(1, keys[:1]) != one_by_one[:32]  # another group, another chunk
    with pytest.raises(ValueError, match="8 or 32"):
        ns.store_key_run(0, [b"x" * 16])


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_lookups_find_exactly_the_chunks_saves_named(xfer, monkeypatch, native):
    """The native lookup names chunks from their store keys itself (``_batchio.c``): it must
    find every chunk the Python naming published, under every leading-bits pattern, and no other."""
    from gdskv.io import batch as batchio

    if native and not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    if not native:
        monkeypatch.setattr(batchio, "_working", False)
    ns = xfer.ns
    keys = chain_keys(list(range(16 * 120)), 16, "names")
    saved = set(range(0, 120, 3)) | {1, 119}
    page = rand_page(5096, 3)
    for i in sorted(saved):
        assert xfer.save_page(0, keys[i], None, [page]).result() is SaveStatus.PUBLISHED
    his = {fmt.chunk_index(ns.store_key(0, keys[i]))[0] for i in saved}
    assert len(his) > 30  # spread over many directories, as real keys are
    want = [i in saved for i in range(len(keys))]
    assert ns.contains_many(0, keys) == want
    assert ns.lease_many(0, keys, lease_seconds=60, present=True) == want
    shutil.rmtree(ns.array_path(0))  # no array directory: nothing there, no error
    assert ns.contains_many(0, keys) == [False] * len(keys)
    assert ns.lease_many(0, keys, lease_seconds=60, present=True) == [False] * len(keys)


def _corrupt_flip(ns, path, _other):
    raw = bytearray(Path(path).read_bytes())
    raw[1234] ^= 0x40
    Path(path).write_bytes(raw)


def _corrupt_truncate(ns, path, _other):
    os.truncate(path, 3000)


def _corrupt_trailer(ns, path, _other):
    raw = bytearray(Path(path).read_bytes())
    raw[-5] ^= 1
    Path(path).write_bytes(raw)


def _foreign_key(ns, path, _other):
    """The file at this key's path is another key's perfectly valid chunk."""
    shutil.copyfile(ns.chunk_path(0, KEYS[3]), path)


def _foreign_namespace(ns, path, other):
    """The file is the same block key's chunk from another namespace (another model)."""
    shutil.copyfile(other.chunk_path(0, KEYS[0]), path)


@pytest.mark.parametrize("damage, reason", [
    (_corrupt_flip, "bad-checksum"), (_corrupt_truncate, "truncated"), (_corrupt_trailer, "bad-trailer"),
    (_foreign_key, "foreign-key"), (_foreign_namespace, "foreign-key"),
])
def test_bad_chunks_are_misses_counted_and_quarantined(xfer, store_path, damage, reason):
    ns = xfer.ns
    other_ns = PageStore.open(store_path).namespace(spec(model="another-model"))
    other = PageTransfer(other_ns, xfer.engine)
    other.save_page(0, KEYS[0], None, [rand_page(5096, 99)]).result()
    xfer.save_page(0, KEYS[0], None, [rand_page(5096, 1)]).result()
    xfer.save_page(0, KEYS[3], KEYS[2], [rand_page(5096, 3)]).result()
    path = ns.chunk_path(0, KEYS[0])
    damage(ns, path, other_ns)
    dst = torch.zeros(5096, dtype=torch.uint8)
    assert xfer.load_page(0, KEYS[0], [dst]).result() is LoadStatus.CORRUPT
    assert ns.counters["loads_corrupt"] == 1 and ns.counters["loads_hit"] == 0
    assert not os.path.exists(path) and ns.contains_many(0, [KEYS[0]]) == [False]
    quarantined = list((Path(store_path) / ".gdskv" / "quarantine" / ns.id / "g0").iterdir())
    assert len(quarantined) == 1 and f".{reason}." in quarantined[0].name
    # the good neighbour is untouched and still loads
    assert xfer.load_page(0, KEYS[3], [dst]).result() is LoadStatus.LOADED
    other.close()


def test_namespaces_never_share_kv(store_path):
    store = PageStore.open(store_path)
    a = store.namespace(spec(dtype="float16"))
    b = store.namespace(spec(dtype="bfloat16"))
    c = store.namespace(spec(tp_rank=1))
    assert len({a.id, b.id, c.id}) == 3
    engine = PosixEngine()
    PageTransfer(a, engine).save_page(0, KEYS[0], None, [rand_page(5096, 0)]).result()
    assert a.contains_many(0, KEYS[:1]) == [True]
    assert b.contains_many(0, KEYS[:1]) == [False] and c.contains_many(0, KEYS[:1]) == [False]
    again = PageStore.open(store_path)
    assert {n.id for n in again.namespaces()} == {a.id, b.id, c.id}
    assert again.namespace(spec(dtype="float16")).contains(0, KEYS[0])
    engine.close()


def test_layer_groups_never_share_kv(store_path):
    ns = PageStore.open(store_path).namespace(spec(groups=2))
    engine = PosixEngine()
    x = PageTransfer(ns, engine)
    x.save_page(0, KEYS[0], None, [rand_page(5096, 0)]).result()
    assert ns.contains_many(1, KEYS[:1]) == [False]
    assert x.load_page(1, KEYS[0], [torch.zeros(5096, dtype=torch.uint8)]).result() is LoadStatus.MISSING
    engine.close()


def test_refuses_directories_that_are_not_stores(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not empty"):
        PageStore.open(tmp_path / "data")
    zarr.open_group(str(tmp_path / "z"), mode="w")
    with pytest.raises(StoreError, match="not a gdskv store"):
        PageStore.open(tmp_path / "z")
    with pytest.raises(StoreError):
        PageStore.open(tmp_path / "absent", create=False)
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_stats_are_persisted_per_process(xfer, store_path):
    xfer.save_page(0, KEYS[0], None, [rand_page(5096, 0)]).result()
    xfer.ns.store.flush_stats()
    files = list((Path(store_path) / ".gdskv" / "stats").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["namespaces"][xfer.ns.id]["saves_published"] == 1


WRITER = textwrap.dedent("""
    import sys, torch
    from gdskv.io.posix import PosixEngine
    from gdskv.keys import chain_keys
    from gdskv.store import GroupSpec, NamespaceSpec, PageStore
    from gdskv.transfer import PageTransfer
    page = 64 << 20
    ns = PageStore.open(sys.argv[1]).namespace(NamespaceSpec("m", "float16", 16, (GroupSpec(0, page, (0,)),)))
    x = PageTransfer(ns, PosixEngine(threads=1), threads=1)
    buf = torch.full((page,), 7, dtype=torch.uint8)
    for i, k in enumerate(chain_keys(list(range(16 * 200)), 16)):
        x.save_page(0, k, None, [buf]).result()
        print(i, flush=True)
""")


def test_writer_killed_mid_write_leaves_no_visible_chunk(store_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, store_path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "0"  # one chunk fully published
        deadline = time.time() + 30
        temp = None
        while time.time() < deadline and temp is None:
            temp = next((p for p in Path(store_path).rglob(f"*{fmt.TMP_MARK}*") if p.stat().st_size > 0), None)
        assert temp is not None, "never caught the writer mid-chunk"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    store = PageStore.open(store_path)
    visible = list(store.iter_chunk_files())
    assert visible, "the first published chunk must survive"
    (ns,) = store.namespaces()
    for _, group, entry in visible:
        raw = Path(entry.path).read_bytes()
        assert len(raw) == (64 << 20) + fmt.TRAILER_BYTES
        t = fmt.unpack(raw[-fmt.TRAILER_BYTES:])
        assert fmt.crc32c(raw[:-fmt.TRAILER_BYTES]) == t.payload_crc
    assert temp.exists(), "the torn write stays a temp file (gc's job), never a chunk"
    keys = chain_keys(list(range(16 * 200)), 16)
    present = ns.contains_many(0, keys)
    assert sum(present) == len(visible) and present[: len(visible)] == [True] * len(visible)


FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from gdskv.io.posix import PosixEngine
    from gdskv.keys import chain_keys
    from gdskv.store import GroupSpec, NamespaceSpec, PageStore
    from gdskv.transfer import PageTransfer
    ns = PageStore.open(sys.argv[1]).namespace(NamespaceSpec("m", "float16", 16, (GroupSpec(0, 1 << 20, (0,)),)))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))  # every chunk write fails (EFBIG)
    x = PageTransfer(ns, PosixEngine())
    st = [x.save_page(0, k, None, [torch.ones(1 << 20, dtype=torch.uint8)]).result().value for k in chain_keys(list(range(64)), 16)]
    print(json.dumps({"statuses": st, "counters": ns.counters.snapshot()}))
""")


def test_a_disk_that_refuses_writes_drops_saves_without_raising(store_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, store_path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["statuses"] == ["dropped"] * 4
    assert res["counters"]["saves_dropped"] == 4
    assert not [p for p in Path(store_path).rglob(f"*{fmt.TMP_MARK}*") if "stats" not in str(p)], "temp files are cleaned up"
    assert list(PageStore.open(store_path).iter_chunk_files()) == []


def test_device_checksum_chunks_round_trip_and_detect_damage(store_path):
    """Pages saved from device memory carry the two-residue polynomial checksum computed with torch
    on the device; here it is forced on CPU pages, and the host form (gdskv verify) agrees."""
    from gdskv import checksum

    ns = PageStore.open(store_path).namespace(spec())
    engine = PosixEngine()
    x = PageTransfer(ns, engine, checksum=fmt.CHECKSUM_POLY)
    src = [rand_page(4096, 1), rand_page(1000, 2)]
    x.save_page(0, KEYS[0], None, src).result()
    raw = Path(ns.chunk_path(0, KEYS[0])).read_bytes()
    t = fmt.unpack(raw[-fmt.TRAILER_BYTES:])
    assert t.checksum_algo == fmt.CHECKSUM_POLY
    assert checksum.poly_hash_host(raw[:-fmt.TRAILER_BYTES]) == t.payload_crc
    dst = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)]
    plain = PageTransfer(ns, engine)  # a reader verifies with the algorithm the chunk names
    assert plain.load_page(0, KEYS[0], dst).result() is LoadStatus.LOADED
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    _corrupt_flip(ns, ns.chunk_path(0, KEYS[0]), None)
    assert plain.load_page(0, KEYS[0], dst).result() is LoadStatus.CORRUPT
    x.close()
    plain.close()
    engine.close()


def test_a_save_reads_the_page_only_once_it_is_ready(xfer):
    """The worker hands a CUDA event recorded on the forward stream; the transfer thread waits
    on it, not the serving thread. A threading.Event plays the event here."""
    import threading

    class Ready:
        def __init__(self) -> None:
            self.flag = threading.Event()

        def synchronize(self) -> None:
            self.flag.wait(10)

    page = torch.zeros(5096, dtype=torch.uint8)
    ready = Ready()
    fut = xfer.save_page(0, KEYS[0], None, [page], ready)
    time.sleep(0.2)
    assert not fut.done() and not xfer.ns.contains(0, KEYS[0])
    page.fill_(42)  # the "kernel" finishes writing the page
    ready.flag.set()
    assert fut.result() is SaveStatus.PUBLISHED
    back = torch.zeros(5096, dtype=torch.uint8)
    assert xfer.load_page(0, KEYS[0], [back]).result() is LoadStatus.LOADED and (back == 42).all()


def test_a_directory_holding_only_what_a_store_being_made_leaves_is_taken_not_refused(tmp_path: Path) -> None:
    """Another process making a store takes ``.gdskv/lock`` before its ``zarr.json`` lands: a
    process opening the path then found a non-empty directory that was not a store, and refused."""
    root = tmp_path / "store"
    (root / ".gdskv").mkdir(parents=True)
    (root / ".gdskv" / "lock").touch()
    (root / "zarr.json.tmp.123.abc").touch()
    assert PageStore.open(root).attributes()["format_version"] == fmt.FORMAT_VERSION
    other = tmp_path / "other"
    (other / ".gdskv").mkdir(parents=True)
    (other / "notes.txt").write_text("someone's")
    with pytest.raises(StoreError, match="not empty"):
        PageStore.open(other)


def test_processes_brought_up_together_on_a_fresh_path_all_open_one_store(tmp_path: Path) -> None:
    """A deployment's ranks start at once on a store path nobody used yet."""
    code = textwrap.dedent("""
        import sys, time
        from gdskv.store import PageStore
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        PageStore.open(sys.argv[1])
    """)
    for attempt in range(2):
        root = tmp_path / f"store{attempt}"
        start = time.time() + 3.0
        procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(start)], stderr=subprocess.PIPE, text=True)
                 for _ in range(6)]
        errors = [p.communicate(timeout=60)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, [e.strip().splitlines()[-1:] for e in errors]
        assert PageStore.open(root, create=False).attributes()["format_version"] == fmt.FORMAT_VERSION
