"""What a byte budget costs as the store grows, with the chunk index against a walk of the store.

Grows one store through the given sizes. Chunks are synthesized the quick way: valid chunk
names hard-linked to one of 256 sparse files (a 1 MiB page + trailer each: no data blocks, and
no inode per chunk), so last-use times take 256 scattered values; in chains of ``--chain``
blocks; journaled as the save path journals a publish (``Budget.on_published``). Their payload is
never read. At each size it
times, in this process unless said otherwise:

- ``fold``: folding the journals into the index snapshot (``catalog.compact``),
- ``bring-up``: ``KvService`` with ``max_bytes`` set (store, namespace, budget, I/O engine),
- ``first save``: one page saved through that service right after bring-up (``save(...).result()``),
- ``choose 10%``: reading the index and ranking every chunk for 10% of the bytes (what ``Budget``
  does before it evicts),
- ``info``: ``gdskv info --json`` in a fresh process (interpreter start and imports included;
  ``import`` is what importing the CLI alone takes, ``counts`` what ``info`` spends on the store),
- ``walk`` (before): ``scan_store``, the walk that bring-up and every eviction did before the
  index (scandir + stat per chunk; parents from the per-array cache) — skipped above
  ``--walk-max`` chunks,
- ``remove`` (with ``--remove``): removing the chosen chunks (``remove_chunks``: rename, lease
  and mtime check, unlink, journal).

Usage: ``python scripts/bench_eviction.py [--sizes 100000,1000000,10000000] [--dir PATH]
[--keep] [--json]``; the default sizes finish in about a minute.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from gdskv import eviction as ev
from gdskv import format as fmt
from gdskv.bench import sigterm_as_exit
from gdskv.config import GdsKvConfig
from gdskv.eviction import catalog
from gdskv.eviction.journal import PUBLISH, journal_of, records
from gdskv.service import KvService
from gdskv.store import GroupSpec, NamespaceSpec, PageStore

PAGE_BYTES = 1 << 20
CHUNK_BYTES = PAGE_BYTES + fmt.TRAILER_BYTES
BATCH = 1 << 20


def _spec() -> NamespaceSpec:
    return NamespaceSpec("bench/evict", "uint8", 16, (GroupSpec(0, PAGE_BYTES, (0,)),))


SOURCES = 256  # sparse files every chunk name links to: 10 million chunks cost no inode and no data block
SRC_DIR = ".gdskv/bench-sources"


def _sources(store: PageStore) -> np.ndarray:
    """The ``SOURCES`` sparse chunk-sized files (made once), each with its own last-use time."""
    d = f"{store.root}/{SRC_DIR}"
    os.makedirs(d, exist_ok=True)
    t0 = time.time_ns() - 10**15
    mtimes = np.array([t0 + k * 10**9 for k in range(SOURCES)], dtype=np.int64)
    for k in range(SOURCES):
        path = f"{d}/{k}"
        if not os.path.exists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.ftruncate(fd, CHUNK_BYTES)
            os.close(fd)
            os.utime(path, ns=(int(mtimes[k]), int(mtimes[k])))
        mtimes[k] = os.stat(path).st_mtime_ns
    return mtimes


def _link_slice(args: tuple[str, str, np.ndarray, np.ndarray]) -> None:
    """Worker: link chunk names ``idx`` to their sources (one ``linkat`` each)."""
    src_dir, base, idx, src = args
    sfd = os.open(src_dir, os.O_RDONLY | os.O_DIRECTORY)
    dirs: dict[int, int] = {}
    try:
        for i, k in zip(idx.tolist(), src.tolist()):
            h, lo = i >> fmt.LO_BITS, i & ((1 << fmt.LO_BITS) - 1)
            dfd = dirs.get(h)
            if dfd is None:
                os.makedirs(f"{base}/{h}/0", exist_ok=True)
                dfd = dirs[h] = os.open(f"{base}/{h}/0", os.O_RDONLY | os.O_DIRECTORY)
            os.link(str(k), str(lo), src_dir_fd=sfd, dst_dir_fd=dfd)
    finally:
        for fd in [sfd, *dirs.values()]:
            os.close(fd)


def synthesize(store: PageStore, start: int, stop: int, chain: int, rng: np.random.Generator, workers: int) -> None:
    """Chunks ``start..stop-1``: valid chunk names hard-linked to one of ``SOURCES`` sparse
    files (block ``i`` the child of ``i - 1`` unless it starts a chain), journaled as the save
    path journals a publish."""
    ns = store.namespace(_spec())
    base = f"{store.root}/ns/{ns.id}/g0/c"
    mtimes = _sources(store)
    journal = journal_of(store)
    # not "fork": a child forked while one of the store's threads holds a lock can hang on it
    with mp.get_context("forkserver").Pool(workers) as pool:
        for lo in range(start, stop, BATCH):
            hi = min(stop, lo + BATCH)
            n = hi - lo
            idx = (rng.integers(0, 1 << fmt.HI_BITS, n, dtype=np.uint64) << np.uint64(fmt.LO_BITS)) | rng.integers(0, 1 << fmt.LO_BITS, n, dtype=np.uint64)
            seq = np.arange(lo, hi)
            parent = np.r_[_last[0], idx[:-1]]  # the previous block, also across batches and sizes
            parent[seq % chain == 0] = ev.NO_PARENT
            _last[0] = idx[-1]
            src = (seq * 7919) % SOURCES  # scattered last-use times
            order = np.argsort(idx >> np.uint64(fmt.LO_BITS), kind="stable")  # one directory per worker slice, mostly
            parts = np.array_split(order, workers * 4)
            pool.map(_link_slice, [(f"{store.root}/{SRC_DIR}", base, idx[p], src[p]) for p in parts])
            journal.append(records(PUBLISH, ns.id, 0, idx, parent, CHUNK_BYTES, mtimes[src]))


_last = [ev.NO_PARENT]


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def measure(root: str, walk: bool, remove: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    store = PageStore.open(root)
    _, out["fold_s"] = _timed(lambda: catalog.compact(store))
    total = catalog.totals(store).nbytes
    cfg = GdsKvConfig(store_path=root, max_bytes=total + 64 * CHUNK_BYTES, engine="posix")
    spec = _spec()
    svc, out["bringup_s"] = _timed(lambda: KvService(cfg, spec))
    try:
        key = os.urandom(32)
        page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        status, out["first_save_s"] = _timed(lambda: svc.transfer.save_page(0, key, None, [page]).result())
        out["first_save"] = str(status.value)
    finally:
        svc.close()
    t = time.perf_counter()
    rows, _, _ = catalog.read(store)
    table = catalog.table(store, rows)
    out["read_s"] = time.perf_counter() - t
    victims = ev.select_victims(table, table.total_bytes // 10, now_ns=time.time_ns())
    out["choose_s"] = time.perf_counter() - t
    out["chunks"] = len(table)
    env = dict(os.environ, GDSKV_STORE=root)
    t = time.perf_counter()
    info = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "info", "--json"], env=env, capture_output=True, text=True)
    out["info_s"] = time.perf_counter() - t
    if info.returncode != 0:
        raise SystemExit(f"gdskv info failed: {info.stderr.strip()}")
    out["info_chunks"] = json.loads(info.stdout)["chunks"]
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gdskv.cli.main"], check=True)
    out["cli_import_s"] = time.perf_counter() - t  # what any gdskv command pays before it starts
    from gdskv.cli.info import chunk_counts
    _, out["info_counts_s"] = _timed(lambda: chunk_counts(PageStore.open(root)))
    if walk:
        _, out["walk_s"] = _timed(lambda: ev.scan_store(store))
    if remove:
        done, out["remove_s"] = _timed(lambda: ev.remove_chunks(store, table, victims))
        out["removed"] = done.removed
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/bench_eviction.py", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20000,100000", help="comma-separated chunk counts (ascending)")
    ap.add_argument("--chain", type=int, default=32, help="blocks per chain")
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="leave the store in --dir (to rerun on it)")
    ap.add_argument("--walk-max", type=int, default=2_000_000, help="time the walk (before) up to this many chunks")
    ap.add_argument("--remove", action="store_true", help="also remove the chosen 10%% (the next size is grown on top)")
    ap.add_argument("--workers", type=int, default=4, help="processes that make the chunk names")
    ap.add_argument("--json", action="store_true", help="one JSON object per size instead of a table")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    base = args.dir or tempfile.mkdtemp(prefix="gdskv-bench-evict-")
    root = os.path.join(base, "store")
    rng = np.random.default_rng(0)
    try:
        store = PageStore.open(root)
        if not os.path.exists(os.path.join(root, catalog.CATALOG)):
            ev.rebuild_catalog(store)  # a new store: its (empty) walk is the index, journals follow
        have = catalog.totals(store).chunks
        if not args.json:
            print(f"{'chunks':>9} {'make s':>8} {'fold s':>7} {'bring-up s':>10} {'1st save s':>10} {'read s':>7} "
                  f"{'choose 10% s':>12} {'info s':>7} {'import s':>8} {'counts s':>8} {'walk s (before)':>15} {'remove s':>9}")
        for n in sizes:
            make_s = 0.0
            if n > have:
                t = time.perf_counter()
                synthesize(store, have, n, args.chain, rng, args.workers)
                make_s = time.perf_counter() - t
                os.sync()  # timings below should not pay for the writeback of what was just made
            r = measure(root, n <= args.walk_max, args.remove)
            r["make_s"] = make_s
            have = catalog.totals(store).chunks
            if args.json:
                print(json.dumps(r))
            else:
                walk = f"{r['walk_s']:.2f}" if "walk_s" in r else "-"
                rem = f"{r['remove_s']:.2f}" if "remove_s" in r else "-"
                print(f"{r['chunks']:>9} {make_s:>8.1f} {r['fold_s']:>7.2f} {r['bringup_s']:>10.3f} {r['first_save_s']:>10.3f} "
                      f"{r['read_s']:>7.2f} {r['choose_s']:>12.2f} {r['info_s']:>7.2f} {r['cli_import_s']:>8.2f} "
                      f"{r['info_counts_s']:>8.3f} {walk:>15} {rem:>9}")
            sys.stdout.flush()
    finally:
        if not args.keep:
            shutil.rmtree(base if not args.dir else root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
