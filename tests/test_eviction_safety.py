"""Eviction on a hostile or busy store (issue 9): nothing outside the store is ever touched, hostile
files never hang a scan, damaged metadata never hides chunks or kills a command, and a lookup's
lease is never lost to an evictor that scanned before it."""
from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner

from gdskv import eviction as ev
from gdskv import format as fmt
from gdskv.cli.main import main as cli_main
from gdskv.config import GdsKvConfig
from gdskv.eviction import install_budget, remove_chunks, scan_store, select_victims
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer, SaveStatus

PAGE = 64
CHUNK = PAGE + 128
TPB = 2


def _spec(groups: int = 1, model: str = "test/safety") -> NamespaceSpec:
    return NamespaceSpec(model, "uint8", TPB, tuple(GroupSpec(g, PAGE, (g,)) for g in range(groups)))


def _save_chains(store: PageStore, ns: Namespace, chains: list[list[int]], group: int = 0, strict: bool = True) -> None:
    engine = PosixEngine(threads=2)
    xfer = PageTransfer(ns, engine, threads=2)
    try:
        for toks in chains:
            keys = chain_keys(toks, TPB)
            for i, k in enumerate(keys):
                page = torch.full((PAGE,), i % 251, dtype=torch.uint8)
                status = xfer.save_page(group, k, keys[i - 1] if i else None, [page]).result()
                assert status == SaveStatus.PUBLISHED or not strict
    finally:
        xfer.close()
        engine.close()


def _chunk_files(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "ns").rglob("*") if p.is_file() and not p.is_symlink() and p.name.isdigit()
                  and p.parent.name == "0")


def cli(root: Path, *args: str) -> Any:
    """A command through click's runner; an exception escaping it fails the test (no tracebacks)."""
    return CliRunner().invoke(cli_main, ["--store", str(root), *args], catch_exceptions=False)


# --- 1. nothing outside the store ---------------------------------------------------------------
def _snapshot(d: Path) -> dict[str, tuple]:
    """Every entry under ``d``: kind, content digest, mtime and atime (links not followed). Each
    entry is ``lstat``-ed before this walk lists or reads it."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = hashlib.sha256(Path(p).read_bytes()).hexdigest() if os.path.isfile(p) and not os.path.islink(p) else None
            out[p] = (st.st_mode, digest, st.st_mtime_ns, st.st_atime_ns)
    return out


_OLD_NS = 1_600_000_000 * 10**9


def _age(canary: Path) -> None:
    """Every atime before its mtime, so that any read (under ``relatime``) or listing moves it."""
    for dirpath, dirnames, filenames in os.walk(canary, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), ns=(_OLD_NS - 10**9, _OLD_NS), follow_symlinks=False)


def _make_canary(canary: Path) -> None:
    """Files named like chunks, laid out so that a link or a hostile group id in the store would
    make them look like an array's chunks."""
    for rel in ("chunks/1", "chunks/2", "chunks/0/1", "chunks/0/2", "cdir/7/0/11", "cdir/7/0/12", "x/c/5/0/9"):
        p = canary / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"precious " + rel.encode() + bytes(CHUNK))


def _hostile_namespace(root: Path, canary_rel: str) -> str:
    """A namespace whose layer group id is a path that climbs out of the store (consistent with its
    directory name, so a reader that trusts the metadata builds paths from it)."""
    d = {"model": "evil", "dtype": "uint8", "tokens_per_block": TPB, "tp_rank": 0, "tp_size": 1, "extra": {},
         "format_version": fmt.FORMAT_VERSION,
         "groups": [{"layer_group_id": canary_rel, "bytes_per_page": PAGE, "layer_ids": [0], "window_size": None}]}
    ns_id = hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]  # as the old reader hashed it
    (root / "ns" / ns_id / "g").mkdir(parents=True)
    (root / "ns" / ns_id / "zarr.json").write_text(json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {"gdskv_namespace": d}}))
    (root / ".gdskv" / "index" / f"{ns_id}.g").mkdir(parents=True, exist_ok=True)
    return ns_id


def test_links_and_hostile_metadata_never_reach_outside_the_store(tmp_path: Path) -> None:
    root, canary = tmp_path / "store", tmp_path / "canary"
    store = PageStore.open(root)
    ns = store.namespace(_spec(groups=2))
    _save_chains(store, ns, [list(range(8)), list(range(100, 108))])
    _make_canary(canary)
    _age(canary)
    os.symlink(canary / "chunks", root / "ns" / ns.id / "g0" / "c" / "4000")  # c/<hi> -> outside
    g1c = root / "ns" / ns.id / "g1" / "c"
    if g1c.exists():
        g1c.rmdir()
    os.symlink(canary / "cdir", g1c)  # g<gid>/c -> outside
    _hostile_namespace(root, "/../../../../canary/x")  # g/../../../../canary/x from ns/<id>/
    before = _snapshot(canary)
    _age(canary)  # what the snapshot just read or listed is sensitive again (it recorded the aged times)

    cli(root, "ls", "--json", "--limit", "0")
    cli(root, "info", "--json")
    fresh = PageStore.open(root)
    budget = install_budget(fresh, GdsKvConfig(store_path=str(root), max_bytes=2 * CHUNK))
    assert budget is not None
    fresh_ns = fresh.namespace(_spec(groups=2))
    _save_chains(fresh, fresh_ns, [list(range(200, 208))], strict=False)  # inline eviction
    assert fresh_ns.counters["evicted"] > 0
    res = cli(root, "evict", "--max-bytes", "0", "--json")
    assert res.exit_code in (0, 1), res.output

    assert _snapshot(canary) == before, "a file outside the store was changed, read, removed or created"
    assert not (tmp_path / "canary" / "x.npy").exists()
    assert _chunk_files(root) == [], "the store's own chunks are still evicted"


# --- 2. hostile files never hang ----------------------------------------------------------------
def _finishes(fn: Callable[[], Any], fifos: list[str], timeout: float = 20.0) -> bool:
    """Run ``fn`` in a thread; if it is still running after ``timeout`` (blocked opening a FIFO),
    release it by opening the FIFOs for writing, and say it hung."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # reported by the assertion below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    while t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(0.05)
    assert "error" not in box, repr(box.get("error"))
    return not hung


def test_a_fifo_at_a_chunk_path_never_hangs_a_scan(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    _save_chains(store, ns, [list(range(8))])
    real = _chunk_files(root)
    fifo = str(Path(real[0]).parent / "12345")
    os.mkfifo(fifo)
    index = root / ".gdskv" / "index" / f"{ns.id}.g0.npy"
    if index.exists():
        index.unlink()
    index.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(index)  # where the parent-index cache is read from
    fifos = [fifo, str(index)]

    assert _finishes(lambda: install_budget(PageStore.open(root), GdsKvConfig(store_path=str(root), max_bytes=10 * CHUNK)), fifos), "bring-up"
    assert _finishes(lambda: cli(root, "ls", "--json"), fifos), "gdskv ls"
    assert _finishes(lambda: cli(root, "info", "--json"), fifos), "gdskv info"
    res: dict[str, Any] = {}
    assert _finishes(lambda: res.setdefault("evict", cli(root, "evict", "--max-bytes", "0", "--json")), fifos), "gdskv evict"
    rep = json.loads(res["evict"].stdout)
    assert rep["chunks_before"] == len(real) and rep["removed"] == len(real), "the FIFO is no chunk"
    assert os.path.exists(fifo) and _chunk_files(root) == []


# --- 3. damaged metadata ------------------------------------------------------------------------
def _plant_namespace(root: Path, ns_id: str, attrs: Any, chunk_src: str, n: int = 3) -> None:
    base = root / "ns" / ns_id
    base.mkdir(parents=True, exist_ok=True)
    (base / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"gdskv_namespace": attrs}}))
    d = base / "g0" / "c" / "3" / "0"
    d.mkdir(parents=True, exist_ok=True)
    data = Path(chunk_src).read_bytes()
    for lo in range(n):
        (d / str(lo + 1)).write_bytes(data)


def test_damaged_namespace_metadata_is_listed_and_its_chunks_evicted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    _save_chains(store, ns, [list(range(8))])  # 4 good chunks
    src = _chunk_files(root)[0]
    _plant_namespace(root, "00000000000000aa", {"model": "no groups", "dtype": "uint8", "tokens_per_block": 2}, src)
    _plant_namespace(root, "00000000000000bb", {"model": 7, "dtype": [], "tokens_per_block": "x", "groups": "abc"}, src)
    _plant_namespace(root, "00000000000000cc", "not a dict", src)
    total = 4 + 9

    res = cli(root, "info", "--json")
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.stdout)
    assert rep["chunks"] == total
    listed = {n["id"]: n for n in rep["namespaces"]}
    assert {"00000000000000aa", "00000000000000bb", "00000000000000cc", ns.id} <= set(listed)
    assert listed["00000000000000aa"].get("damaged") and not listed[ns.id].get("damaged")
    assert "Traceback" not in cli(root, "info").output
    res = cli(root, "ls", "--json", "--limit", "0")
    assert res.exit_code in (0, 1) and json.loads(res.stdout)["total"] == total
    assert "00000000000000aa" in cli(root, "ls").output
    res = cli(root, "evict", "--max-bytes", "0", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["removed"] == total
    assert _chunk_files(root) == []


def test_chunks_of_a_namespace_whose_metadata_claims_other_dimensions_are_evicted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    _save_chains(store, ns, [list(range(8)), list(range(50, 58))])  # 8 chunks
    meta = root / "ns" / ns.id / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"]["gdskv_namespace"]["groups"][0]["bytes_per_page"] = 4 * PAGE  # no longer its id's spec
    meta.write_text(json.dumps(d))

    assert json.loads(cli(root, "info", "--json").stdout)["chunks"] == 8
    res = cli(root, "evict", "--max-bytes", "0")
    assert res.exit_code == 0, res.output
    assert "removed 8 of 8" in res.output
    assert _chunk_files(root) == []


# --- 4. leases and removal ----------------------------------------------------------------------
def _lease(ns: Namespace, group: int, keys: list[bytes], seconds: float) -> list[bool]:
    if hasattr(ns, "lease_many"):
        return list(ns.lease_many(group, keys, seconds))
    return [ns.touch_many(group, [k], lease_seconds=seconds) == 1 for k in keys]


def test_a_lease_set_after_the_scan_vetoes_the_removal(tmp_path: Path) -> None:
    """The evictor scans, then a lookup leases a prefix, then the evictor removes: the leased
    chunks and their ancestors stay, the rest goes."""
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    a, b = list(range(8)), list(range(100, 108))
    _save_chains(store, ns, [a, b])
    table = scan_store(store)
    rows = select_victims(table, None, now_ns=time.time_ns())
    assert rows.size == 8
    keys = chain_keys(a, TPB)
    assert _lease(ns, 0, keys[:3], 30) == [True] * 3
    done = remove_chunks(store, table, rows)
    assert ns.contains_many(0, keys) == [True, True, True, False]
    assert not any(ns.contains_many(0, chain_keys(b, TPB)))
    assert done.removed == 5 and done.failed == 0
    assert not [n for n in os.listdir(Path(ns.chunk_path(0, keys[0])).parent) if fmt.is_temp_name(n)], "no doomed file left"


def test_evict_does_not_report_failed_removals_as_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    _save_chains(store, ns, [list(range(8))])

    def refuse(*a: Any, **k: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", refuse)
    monkeypatch.setattr(os, "rename", refuse)
    monkeypatch.setattr(os, "replace", refuse)
    res = cli(root, "evict", "--max-bytes", "0")
    j = cli(root, "evict", "--max-bytes", "0", "--json")
    monkeypatch.undo()
    assert res.exit_code == 1 and j.exit_code == 1
    assert "removed 4 of 4" not in res.output and "removed 0 of 4" in res.output, res.output
    assert "4 failed" in res.output, res.output
    rep = json.loads(j.stdout)
    assert rep["removed"] == 0 and rep["failed"] == 4
    assert len(_chunk_files(root)) == 4


def test_admit_never_raises_into_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec())
    budget = install_budget(store, GdsKvConfig(store_path=str(root), max_bytes=2 * CHUNK))
    _save_chains(store, ns, [list(range(4))])
    assert budget.counted.wait(10)
    stored = budget.used_bytes

    def broken(*a: Any, **k: Any) -> Any:
        raise ValueError("bad metadata")

    monkeypatch.setattr(ev.catalog, "read", broken)  # the index read before an eviction
    engine = PosixEngine(threads=1)
    xfer = PageTransfer(ns, engine, threads=1)
    try:
        keys = chain_keys(list(range(300, 304)), TPB)
        status = xfer.save_page(0, keys[0], None, [torch.zeros(PAGE, dtype=torch.uint8)]).result()
    finally:
        xfer.close()
        engine.close()
    assert status == SaveStatus.DROPPED
    assert ns.counters["eviction_errors"] == 1
    assert budget.used_bytes == stored, "the dropped save holds no room"


# --- the race: real processes leasing and evicting at once --------------------------------------
RACE_SPEC = dict(model="test/race", dtype="uint8", tokens_per_block=TPB, groups=[{"layer_group_id": 0, "bytes_per_page": PAGE,
                                                                                  "layer_ids": [0], "window_size": None}])
CHAIN = 4


def _race_keys(i: int) -> list[bytes]:
    return chain_keys([i * 1000 + t for t in range(CHAIN * TPB)], TPB)


def _race_ns(root: str) -> Namespace:
    return PageStore.open(root, create=False).namespace(NamespaceSpec.from_json(RACE_SPEC))


def _ready(go: Any) -> None:
    """Say this worker is ready (imports done), then wait for the start."""
    event, ready = go
    with ready.get_lock():
        ready.value += 1
    event.wait()


def _race_writer(root: str, published: Any, go: Any, stop: Any) -> None:
    """Publishes chain after chain of never-reused keys (temp file + rename), as a save does."""
    ns = _race_ns(root)
    payload = bytes(PAGE)
    _ready(go)
    i, seq = 0, 0
    while not stop.is_set():
        keys = _race_keys(i)
        for j, k in enumerate(keys):
            path = ns.chunk_path(0, k)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            trailer = fmt.pack(fmt.Trailer(0, PAGE, fmt.crc32c(payload), ns.store_key(0, k), k, keys[j - 1] if j else None))
            tmp = f"{path}{fmt.TMP_MARK}{os.getpid()}.{seq:08x}"
            seq += 1
            with open(tmp, "wb") as f:
                f.write(payload + trailer)
            os.rename(tmp, path)
        i += 1
        published.value = i
        time.sleep(0.002)


def _race_leaser(root: str, published: Any, go: Any, stop: Any, out: str) -> None:
    """Leases random recent chains as a lookup does; records every chunk whose lease was set."""
    ns = _race_ns(root)
    rng = random.Random(7)
    leased: list[list[int]] = []
    attempts = 0
    _ready(go)
    while not stop.is_set():
        n = published.value
        if n == 0:
            time.sleep(0.001)
            continue
        i = rng.randrange(max(0, n - 30), n)
        ok = _lease(ns, 0, _race_keys(i), 30)
        attempts += 1
        served = ok.index(False) if False in ok else len(ok)  # a lookup serves the prefix up to the first miss
        leased += [[i, j] for j in range(served)]
    Path(out).write_text(json.dumps({"attempts": attempts, "leased": leased}))


def _race_evictor(root: str, go: Any, stop: Any, out: str, via_cli: bool) -> None:
    """Evicts everything it may, over and over: ``remove_chunks`` or ``gdskv evict --max-bytes 0``."""
    store = PageStore.open(root, create=False)
    rounds = removed = kept = 0
    _ready(go)
    while not stop.is_set():
        if via_cli:
            res = CliRunner().invoke(cli_main, ["--store", root, "evict", "--max-bytes", "0", "--json"])
            try:
                removed += json.loads(res.stdout).get("removed", 0)
            except ValueError:
                pass
        else:
            table = scan_store(store)
            done = remove_chunks(store, table, select_victims(table, None, now_ns=time.time_ns()))
            removed += done.removed
            kept += done.skipped_pinned + getattr(done, "skipped_leased", 0)
        rounds += 1
    Path(out).write_text(json.dumps({"rounds": rounds, "removed": removed, "kept_at_removal": kept}))


@pytest.mark.slow
def test_no_lease_is_lost_to_racing_evictors(tmp_path: Path) -> None:
    """One process publishes, one leases random recent chains (recording which leases were set), two
    evict everything they may (one through ``remove_chunks``, one through ``gdskv evict``) for ~10 s.
    Keys are never reused, so a chunk missing at the end was evicted: no leased chunk may be."""
    root = str(tmp_path / "store")
    ns = PageStore.open(root).namespace(NamespaceSpec.from_json(RACE_SPEC))
    assert ns.id
    ctx = mp.get_context("spawn")
    published, stop = ctx.Value("q", 0), ctx.Event()
    go = (ctx.Event(), ctx.Value("i", 0))
    outs = {name: str(tmp_path / f"{name}.json") for name in ("leaser", "evict_api", "evict_cli")}
    procs = [ctx.Process(target=_race_writer, args=(root, published, go, stop)),
             ctx.Process(target=_race_leaser, args=(root, published, go, stop, outs["leaser"])),
             ctx.Process(target=_race_evictor, args=(root, go, stop, outs["evict_api"], False)),
             ctx.Process(target=_race_evictor, args=(root, go, stop, outs["evict_cli"], True))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    while go[1].value < len(procs) and time.monotonic() < deadline and all(p.is_alive() for p in procs):
        time.sleep(0.05)
    assert go[1].value == len(procs), "a worker did not start"
    go[0].set()
    time.sleep(float(os.environ.get("GDSKV_RACE_SECONDS", "10")))
    stop.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lease = json.loads(Path(outs["leaser"]).read_text())
    api, via_cli = (json.loads(Path(outs[k]).read_text()) for k in ("evict_api", "evict_cli"))
    leased = {(i, j) for i, j in lease["leased"]}
    missing = sorted((i, j) for i, j in leased if not ns.contains(0, _race_keys(i)[j]))
    print(f"race: {published.value} chains published, {lease['attempts']} lookups, {len(lease['leased'])} leases set on {len(leased)} chunks; "
          f"evictors removed {api['removed']} (api, {api['rounds']} rounds, {api['kept_at_removal']} kept at removal) + "
          f"{via_cli['removed']} (cli, {via_cli['rounds']} rounds); leased chunks missing: {len(missing)}")
    assert lease["leased"] and api["removed"] + via_cli["removed"] > 0, "the race did not happen"
    assert missing == [], f"{len(missing)} of {len(leased)} leased chunks were evicted"


_SAVER = r"""
import sys, torch
from gdskv.config import GdsKvConfig
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec
root, wid, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = NamespaceSpec("mp/budget", "uint8", 2, (GroupSpec(0, 4096, (0,)),))
svc = KvService(GdsKvConfig(store_path=root, max_bytes=max_bytes, host_bytes=0), spec)
page = [torch.full((4096,), wid, dtype=torch.uint8)]
for chain in range(60):
    keys = svc.keys([wid * 10**6 + chain * 1000 + t for t in range(9)])
    for f in [svc.save(0, k, keys[i - 1] if i else None, page) for i, k in enumerate(keys)]:
        f.result(timeout=30)
svc.close()
"""


def test_processes_sharing_a_store_keep_it_near_its_budget(tmp_path):
    """Processes on one store each admit saves against the index as they last read it: each
    filled the whole room it showed (three processes left a store three times over its budget,
    for good). Each now reads the index again once it admitted ``headroom`` of the budget since,
    and evicts what a read shows beyond the limits."""
    import subprocess
    import sys as _sys

    root = tmp_path / "store"
    chunk = 4096 + 128
    budget_chunks = 64
    procs = [subprocess.Popen([_sys.executable, "-c", _SAVER, str(root), str(w), str(budget_chunks * chunk)])
             for w in range(1, 4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    stored = sum(e.stat().st_size for _, _, e in PageStore.open(root, create=False).iter_chunk_files())
    # each process may run ahead of the others' saves by its allowance (four chunks here) at most
    assert stored <= (budget_chunks + 3 * 4) * chunk, f"{stored // chunk} chunks stored, budget {budget_chunks}"
