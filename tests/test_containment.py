"""Nothing outside the store is ever touched, and hostile entries inside it are misses, never hangs
or exceptions: regression tests for issue 9's defects 1, 3, 4, 5, 7, 8, 11 and 12, on real files.

Each test that could reach outside the store builds a canary directory beside it and checks,
afterwards, that every entry in it kept its name, size, mode, inode and times (a read through a
link would move an aged atime; a touch, a rename or a removal shows in the rest)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gdskv import format as fmt
from gdskv.cli.main import main as cli_main
from gdskv.garbage import collect, find_garbage
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import LoadStatus, PageTransfer, SaveStatus

KEYS = chain_keys(list(range(16 * 16)), 16, "contain")
PAGE = 8192
OLD = 1_600_000_000 * 10**9  # 2020: far older than relatime's day, so any read through a link shows


def spec(page: int = PAGE) -> NamespaceSpec:
    return NamespaceSpec("contain/m", "float16", 16, (GroupSpec(0, page, (0,)),))


def page(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Canary:
    """A directory outside the store holding what gdskv would damage if it followed a link:
    files named like chunks and temp files, aged; an empty chunk-like directory tree."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "7" / "0").mkdir(parents=True)
        (root / "8" / "0").mkdir(parents=True)
        for name, data in (("0", b"zero"), ("123", b"x" * (PAGE + fmt.TRAILER_BYTES)), ("x.tmp.999999", b"t"),
                           ("7/0/5", b"chunk-like"), ("victim", b"keep me")):
            (root / name).write_bytes(data)
        for p in sorted(root.rglob("*"), reverse=True) + [root]:
            os.utime(p, ns=(OLD, OLD), follow_symlinks=False)
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, tuple]:
        out = {}
        for p in [self.root, *self.root.rglob("*")]:
            st = os.lstat(p)
            out[str(p.relative_to(self.root))] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_atime_ns)
        return out

    def assert_untouched(self) -> None:
        assert self.snapshot() == self.before


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    return Canary(tmp_path / "canary")


@pytest.fixture
def saved(store_path: str):
    """A store with 4 published chunks of one chain; yields (store, namespace, transfer)."""
    store = PageStore.open(store_path)
    ns = store.namespace(spec())
    engine = PosixEngine(threads=2, o_direct=True)
    xfer = PageTransfer(ns, engine, threads=2)
    for i in range(4):
        assert xfer.save_page(0, KEYS[i], KEYS[i - 1] if i else None, [page(i)]).result() is SaveStatus.PUBLISHED
    yield store, ns, xfer
    xfer.close()
    engine.close()


def cli(store: str, *args: str):
    res = CliRunner().invoke(cli_main, ["--store", store, *args])
    assert "Traceback" not in res.output and (res.exception is None or isinstance(res.exception, SystemExit)), res.output
    return res


def chunk(ns, i: int) -> Path:
    return Path(ns.chunk_path(0, KEYS[i]))


def load(xfer: PageTransfer, i: int, timeout: float = 20.0) -> LoadStatus:
    """A load that must finish: a hang fails the test instead of stalling it."""
    return xfer.load_page(0, KEYS[i], [torch.zeros(PAGE, dtype=torch.uint8)]).result(timeout=timeout)


# --- defect 1: links and crafted metadata ---------------------------------------------------------
def test_gc_refuses_a_store_whose_private_dir_is_a_link_to_outside(saved, canary):
    store, _, _ = saved
    shutil.rmtree(store.private)
    os.symlink(canary.root, store.private)
    res = cli(str(store.root), "gc", "--min-age", "0s", "--grace", "0s")
    assert res.exit_code == 2 and "link" in res.output
    done = collect(store, find_garbage(store, 0, 0))  # a server that opened the store before the swap
    assert done.removed_temp_files == 0
    canary.assert_untouched()


def test_gc_and_verify_do_not_enter_a_chunk_directory_linked_to_outside(saved, canary):
    store, ns, _ = saved
    hi_dir = chunk(ns, 0).parent.parent
    shutil.rmtree(hi_dir)
    os.symlink(canary.root, hi_dir)  # c/<hi> -> canary, which holds a file named like a chunk
    cdir = hi_dir.parent
    os.symlink(canary.root, cdir / "9")  # another <hi> whose "0/" would look empty
    res = cli(str(store.root), "verify", "--repair")
    assert res.exit_code in (0, 1)
    res = cli(str(store.root), "gc", "--min-age", "0s", "--grace", "0s")
    assert res.exit_code == 0
    canary.assert_untouched()


def test_gc_does_not_remove_outside_directories_through_a_linked_array_chunk_root(saved, canary):
    store, ns, _ = saved
    cdir = ns.array_path(0) / "c"
    shutil.rmtree(cdir)
    os.symlink(canary.root, cdir)  # the canary holds empty 8/0 and aged temp files
    assert cli(str(store.root), "gc", "--min-age", "0s", "--grace", "0s").exit_code == 0
    assert cli(str(store.root), "verify", "--repair").exit_code in (0, 1)
    canary.assert_untouched()


def test_namespace_metadata_with_a_path_as_layer_group_is_ignored(saved, canary):
    store, ns, _ = saved
    meta = ns.path / "zarr.json"
    doc = json.loads(meta.read_text())
    rel = os.path.relpath(canary.root / "x", ns.path)
    doc["attributes"]["gdskv_namespace"]["groups"][0]["layer_group_id"] = "/" + rel
    meta.write_text(json.dumps(doc))
    fresh = PageStore.open(store.root)
    assert [n.id for n in fresh.namespaces()] == []
    assert [i for i, _ in fresh.damaged_namespaces()] == [ns.id]
    for args in (("gc", "--min-age", "0s", "--grace", "0s"), ("verify", "--repair"), ("stats",)):
        assert cli(str(store.root), *args).exit_code in (0, 1)
    canary.assert_untouched()


def test_load_and_lease_of_a_chunk_that_is_a_link_leave_its_target_alone(saved, canary):
    store, ns, xfer = saved
    target = chunk(ns, 1)
    os.unlink(target)
    os.symlink(canary.root / "123", target)
    assert ns.lease_many(0, [KEYS[1]], 30) == [True]  # the link's own times, never the target's
    assert not ns.contains(0, KEYS[1])
    assert load(xfer, 1) is LoadStatus.CORRUPT
    assert not os.path.lexists(target)
    assert any(p.name.startswith(target.name + ".link.") for p in (store.private / "quarantine").rglob("*"))
    canary.assert_untouched()


def test_saves_never_write_through_a_linked_chunk_directory(saved, canary):
    store, ns, xfer = saved
    hi_dir = chunk(ns, 5).parent.parent
    if hi_dir.exists():
        shutil.rmtree(hi_dir)
    os.symlink(canary.root, hi_dir)
    assert xfer.save_page(0, KEYS[5], KEYS[4], [page(5)]).result() is SaveStatus.DROPPED
    canary.assert_untouched()


# --- defect 3 (and 8): non-regular files where a chunk belongs --------------------------------------
def _hostile(kind: str, path: Path) -> None:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inner").write_bytes(b"x")
    elif kind == "socket":  # bound at a short path (AF_UNIX limits its length), then moved into place
        short = f"/tmp/gdskv-sock-{os.getpid()}"
        s = socket.socket(socket.AF_UNIX)
        s.bind(short)
        s.close()
        os.rename(short, path)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "device"])
def test_a_non_regular_file_at_a_chunk_path_is_a_miss_not_a_hang(saved, kind):
    store, ns, xfer = saved
    path = chunk(ns, 2)
    try:
        _hostile(kind, path)
    except PermissionError:
        pytest.skip(f"cannot make a {kind} here")
    assert not ns.contains(0, KEYS[2])
    assert load(xfer, 2) is LoadStatus.CORRUPT  # quarantined (the entry itself moved), never opened for data
    assert not os.path.lexists(path)
    assert xfer.engine.o_direct  # defect 8: a directory's EINVAL no longer turns O_DIRECT off for good
    assert xfer.save_page(0, KEYS[2], KEYS[1], [page(2)]).result() is SaveStatus.PUBLISHED
    assert load(xfer, 2) is LoadStatus.LOADED


def test_a_save_over_a_directory_at_its_chunk_path_quarantines_it_and_publishes(saved):
    store, ns, xfer = saved
    path = chunk(ns, 6)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    (path / "inner").write_bytes(b"x")
    assert xfer.save_page(0, KEYS[6], KEYS[5], [page(6)]).result() is SaveStatus.PUBLISHED
    assert load(xfer, 6) is LoadStatus.LOADED


def test_verify_reports_non_regular_entries_at_chunk_paths(saved):
    store, ns, _ = saved
    os.unlink(chunk(ns, 3))
    chunk(ns, 3).mkdir()
    os.unlink(chunk(ns, 0))
    os.mkfifo(chunk(ns, 0))
    res = cli(str(store.root), "verify", "--json")
    rep = json.loads(res.output)
    assert res.exit_code == 1 and rep["reasons"] == {"not-a-file": 2}


# --- defect 4: a quarantine that cannot happen ------------------------------------------------------
def test_a_corrupt_chunk_that_cannot_be_quarantined_is_a_miss_without_an_exception(saved):
    store, ns, xfer = saved
    qdir = store.private / "quarantine"
    shutil.rmtree(qdir, ignore_errors=True)
    qdir.write_bytes(b"not a directory")  # every quarantine move now fails (as on a read-only store)
    raw = bytearray(chunk(ns, 1).read_bytes())
    raw[10] ^= 1
    chunk(ns, 1).write_bytes(bytes(raw))
    for _ in range(3):
        assert load(xfer, 1) is LoadStatus.CORRUPT
    assert chunk(ns, 1).exists() and not ns.contains(0, KEYS[1])  # stays, but lookups skip it
    assert ns.counters["quarantine_failed"] >= 1
    res = cli(str(store.root), "verify", "--repair")
    assert res.exit_code == 1 and "could not be quarantined" in res.output
    # a chunk of the right size but remembered unusable is not a stored page: a save rewrites it
    assert xfer.save_page(0, KEYS[1], KEYS[0], [page(1)]).result() is SaveStatus.PUBLISHED
    assert load(xfer, 1) is LoadStatus.LOADED


# --- defect 5: malformed namespace metadata ---------------------------------------------------------
@pytest.mark.parametrize("mutate", [
    lambda a: a.pop("groups"),
    lambda a: a.update(groups="nope"),
    lambda a: a.update(groups=[{"layer_group_id": 0, "bytes_per_page": "8192", "layer_ids": [0]}]),
    lambda a: a.update(tokens_per_block=-3),
    lambda a: a.update(tp_rank=5),
    lambda a: a["groups"][0].update(bytes_per_page=2 * PAGE),  # claims other dimensions
], ids=["no-groups", "groups-not-a-list", "page-size-a-string", "negative-tokens", "rank-out-of-range", "other-dimensions"])
def test_malformed_namespace_metadata_is_a_damaged_namespace_not_a_traceback(saved, mutate):
    store, ns, _ = saved
    meta = ns.path / "zarr.json"
    doc = json.loads(meta.read_text())
    mutate(doc["attributes"]["gdskv_namespace"])
    meta.write_text(json.dumps(doc))
    fresh = PageStore.open(store.root)
    assert fresh.namespaces() == [] and [i for i, _ in fresh.damaged_namespaces()] == [ns.id]
    assert len([a for a in fresh.arrays() if a.namespace is None]) == 1  # its chunks are still found
    for args in (("gc",), ("verify",), ("stats",)):
        assert cli(str(store.root), *args).exit_code in (0, 1)
    other = fresh.namespace(NamespaceSpec("contain/other", "float16", 16, (GroupSpec(0, PAGE, (0,)),)))
    assert other.id != ns.id  # bring-up of another namespace is unaffected


def test_invalid_json_namespace_metadata_is_ignored(saved):
    store, ns, _ = saved
    (ns.path / "zarr.json").write_bytes(b"\xff{not json")
    assert PageStore.open(store.root).namespaces() == []


# --- defect 7: the store removed under a running server --------------------------------------------
def test_a_store_removed_under_a_server_is_not_recreated_and_saves_are_not_reported_published(saved):
    store, ns, xfer = saved
    shutil.rmtree(store.root)
    assert xfer.save_page(0, KEYS[10], None, [page(10)]).result() is SaveStatus.DROPPED
    assert load(xfer, 0) is LoadStatus.MISSING
    ns.counters.add("lookups")
    store.flush_stats()
    assert not store.root.exists()


# --- defect 11: full disk ---------------------------------------------------------------------------
def _run_with_file_size_limit(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "limited.py"
    script.write_text(textwrap.dedent(code))
    pre = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); ")
    return subprocess.run([sys.executable, "-c", pre + f"exec(open({str(script)!r}).read())"], capture_output=True, text=True,
                          timeout=120)


def test_stats_on_a_full_disk_leave_no_temp_file(store_path, tmp_path):
    PageStore.open(store_path).namespace(spec())
    res = _run_with_file_size_limit(f"""
        from gdskv.store import PageStore
        from gdskv.store import GroupSpec, NamespaceSpec
        spec = lambda: NamespaceSpec("contain/m", "float16", 16, (GroupSpec(0, 8192, (0,)),))
        store = PageStore.open({store_path!r})
        ns = store.namespace(spec())
        for i in range(50):
            ns.counters.add(f"counter_{{i}}", i)
        store.flush_stats()
        print("flushed")
    """, tmp_path)
    assert res.returncode == 0 and "flushed" in res.stdout, res.stderr
    leftovers = [p for p in Path(store_path, ".gdskv").rglob("*") if fmt.is_temp_name(p.name)]
    assert leftovers == []


def test_creating_a_namespace_on_a_full_disk_is_an_error_that_names_it(store_path, tmp_path):
    PageStore.open(store_path)
    res = _run_with_file_size_limit(f"""
        from gdskv.store import PageStore
        from gdskv.store import GroupSpec, NamespaceSpec
        spec = lambda: NamespaceSpec("contain/m", "float16", 16, (GroupSpec(0, 8192, (0,)),))
        try:
            PageStore.open({store_path!r}).namespace(spec())
        except OSError as e:
            print("OSError:", e)
    """, tmp_path)
    assert res.returncode == 0 and "OSError: [Errno 27] cannot create namespace" in res.stdout, res.stderr


# --- defect 12: owner-only files by default, file_mode applied exactly ------------------------------
def _modes(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for p in [root, *root.rglob("*")]:
        st = os.lstat(p)
        (dirs if stat.S_ISDIR(st.st_mode) else files).add(stat.S_IMODE(st.st_mode))
    return files, dirs


def _populate(root: Path, file_mode: int, dir_mode: int) -> None:
    store = PageStore.open(root, file_mode=file_mode, dir_mode=dir_mode)
    ns = store.namespace(spec())
    engine = PosixEngine(threads=1, file_mode=file_mode)
    xfer = PageTransfer(ns, engine, threads=1)
    for i in range(3):
        xfer.save_page(0, KEYS[i], KEYS[i - 1] if i else None, [page(i)]).result()
    raw = bytearray(chunk(ns, 2).read_bytes())
    raw[0] ^= 1
    chunk(ns, 2).write_bytes(bytes(raw))
    assert load(xfer, 2) is LoadStatus.CORRUPT  # quarantine dirs and the moved file
    xfer.close()  # stats
    engine.close()


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o600, 0o700), (0o077, 0o640, 0o750)],
                         ids=["owner-only-by-default", "group-mode-applied-exactly"])
def test_every_file_and_directory_gets_the_configured_mode_whatever_the_umask(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        _populate(tmp_path / "store", file_mode, dir_mode)
    finally:
        os.umask(old)
    files, dirs = _modes(tmp_path / "store")
    assert files == {file_mode} and dirs == {dir_mode}


@pytest.mark.parametrize("native", [True, False], ids=["native", "per-key"])
def test_presence_and_leases_see_only_regular_chunks_of_full_size_on_both_paths(saved, canary, monkeypatch, native):
    """A lookup's presence checks and leases (one native call, or key by key in Python) agree:
    a link, a truncated file or a FIFO at a chunk path is absent, a missing chunk cannot be
    leased, a lease sets the atime ahead, and nothing outside the store is touched."""
    import time

    from gdskv.io import batch as batchio

    if native and not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    if not native:
        monkeypatch.setattr(batchio, "_working", False)
    store, ns, xfer = saved
    os.unlink(chunk(ns, 1))
    os.symlink(canary.root / "123", chunk(ns, 1))
    with open(chunk(ns, 2), "r+b") as f:
        f.truncate(PAGE // 2)
    os.unlink(chunk(ns, 3))
    os.mkfifo(chunk(ns, 3))
    missing = chain_keys(list(range(64)), 16, "elsewhere")[0]
    assert ns.contains_many(0, [KEYS[0], KEYS[1], KEYS[2], KEYS[3], missing]) == [True, False, False, False, False]
    # a lookup's check and lease in one pass sees the same
    assert ns.lease_many(0, [KEYS[0], KEYS[1], KEYS[2], KEYS[3], missing], 30, present=True) == [True, False, False, False, False]
    before = time.time_ns()
    assert ns.lease_many(0, [KEYS[0], missing], 30) == [True, False]
    st = os.lstat(chunk(ns, 0))
    assert st.st_atime_ns >= before + 30 * 10**9 and before <= st.st_mtime_ns < before + 10**9
    canary.assert_untouched()


def test_native_presence_never_follows_a_linked_chunk_directory(saved, canary):
    """The chunk's directory replaced by a link to a copy outside the store: the native presence
    check resolves beneath the root without links, so the chunk is absent (and untouched)."""
    from gdskv.io import batch as batchio

    if not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    store, ns, xfer = saved
    directory = chunk(ns, 0).parent
    outside = canary.root / "copied-dir"
    shutil.copytree(directory, outside)
    canary.before = canary.snapshot()
    shutil.rmtree(directory)
    os.symlink(outside, directory)
    assert ns.contains_many(0, [KEYS[0]]) == [False]
    assert ns.lease_many(0, [KEYS[0]], 30) == [False]
    canary.assert_untouched()


# --- hard links and oversized files planted in the store ------------------------------------------
def _plant_links(target: Path, directory: Path, names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.link(target, directory / name)


@pytest.mark.parametrize("native", [True, False], ids=["native", "per-page"])
def test_a_save_never_writes_through_a_hard_link_at_its_temp_name(saved, canary, monkeypatch, native):
    """Temp names are predictable (pid and a counter): hard links to a file outside the store
    planted at every name the next saves could take are unlinked, never written through, and the
    save still publishes."""
    from gdskv.io import batch as batchio

    if native and not batchio.available():
        pytest.skip("the native batch path (gdskv.io._batchio) is not built in this environment")
    if not native:
        monkeypatch.setattr(batchio, "_working", False)
    store, ns, xfer = saved
    name = chunk(ns, 5).name
    _plant_links(canary.root / "victim", chunk(ns, 5).parent, [f"{name}{fmt.TMP_MARK}{os.getpid()}.{seq:x}" for seq in range(64)])
    assert xfer.save_page(0, KEYS[5], KEYS[4], [page(5)]).result() is SaveStatus.PUBLISHED
    target = torch.zeros(PAGE, dtype=torch.uint8)
    assert xfer.load_page(0, KEYS[5], [target]).result(timeout=20) is LoadStatus.LOADED and torch.equal(target, page(5))
    canary.assert_untouched()


def test_a_chunk_fetched_from_the_remote_never_writes_through_a_hard_link_at_its_temp_name(saved, canary):
    from gdskv.remote import objects

    store, ns, xfer = saved
    data = chunk(ns, 0).read_bytes()
    os.unlink(chunk(ns, 0))
    first = next(objects._seq) + 1
    _plant_links(canary.root / "victim", chunk(ns, 0).parent,
                 [f"{chunk(ns, 0).name}{fmt.TMP_MARK}{os.getpid()}.r{seq:x}" for seq in range(first, first + 64)])
    assert objects.publish(ns, 0, KEYS[0], data)
    assert chunk(ns, 0).read_bytes() == data
    canary.assert_untouched()


def test_a_hard_link_at_the_stores_lock_keeps_its_mode(tmp_path, canary):
    """The store's lock file, opened on every namespace creation, is given the store's file mode
    only when gdskv creates it: a hard link planted there to a private file outside is not
    chmodded to a shared store's 0644."""
    path = tmp_path / "shared-store"
    PageStore.open(path)
    lock = path / ".gdskv" / "lock"
    lock.unlink(missing_ok=True)
    os.chmod(canary.root / "victim", 0o600)
    canary.before = canary.snapshot()
    os.link(canary.root / "victim", lock)
    PageStore.open(path, file_mode=0o644, dir_mode=0o755).namespace(spec())
    canary.assert_untouched()


def test_an_oversized_sparse_chunk_is_refused_unread_by_verify_and_the_uploader(saved):
    """A terabyte sparse file where a chunk belongs: ``gdskv verify`` calls it bad-size without
    reading it (the old check allocated its size and failed the whole run), and the uploader
    refuses to read it into the serving process."""
    from gdskv.remote.objects import read_local

    store, ns, xfer = saved
    with open(chunk(ns, 1), "r+b") as f:
        f.truncate(1 << 40)
    res = cli(str(store.root), "verify")
    assert res.exit_code == 1 and "bad-size 1" in res.output, res.output
    rel = os.path.relpath(chunk(ns, 1), store.root)
    with pytest.raises(OSError) as e:
        read_local(store, rel, PAGE + fmt.TRAILER_BYTES)
    assert e.value.errno == errno.EFBIG
    assert read_local(store, os.path.relpath(chunk(ns, 0), store.root), PAGE + fmt.TRAILER_BYTES) == chunk(ns, 0).read_bytes()
