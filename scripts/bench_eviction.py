"""How eviction scales with the number of chunks in a store.

Grows one store through the given sizes (chunks of tiny pages, in chains of ``--chain`` blocks,
published through the transfer layer's chunk writer, ``gdskv.bench.ChunkWriter``) and, at each size, times:

- ``index cold``: ``scan_store`` with no index cache (scandir + stat + one trailer read per chunk),
- ``index warm``: ``scan_store`` again (scandir + stat; parents from ``.gdskv/index``),
- ``pick``: ranking every chunk and choosing victims for 10% of the bytes (``select_victims``),
- ``remove``: unlinking those victims (``remove_chunks``),
- ``rescan``: the scan after removal (the index cache is rewritten).

Usage: ``python scripts/bench_eviction.py [--sizes 20000,100000] [--dir PATH] [--json]``.
The defaults finish in about a minute; ``--sizes 100000,1000000`` is the note's measurement.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

from gdskv import eviction as ev
from gdskv.bench import ChunkWriter
from gdskv.store import GroupSpec, NamespaceSpec, PageStore

PAGE_BYTES = 16


def grow(store: PageStore, ns_spec: NamespaceSpec, start: int, stop: int, chain: int) -> None:
    """Write chunks ``start..stop-1`` (block ``i`` is the child of ``i-1`` unless it starts a chain)."""
    ns = store.namespace(ns_spec)
    payload = bytes(PAGE_BYTES)
    t0 = time.time_ns() - 10**12
    stamps: list[tuple[str, int]] = []
    with ChunkWriter(ns) as writer:
        for i in range(start, stop):
            key = hashlib.sha256(i.to_bytes(8, "little")).digest()
            parent = None if i % chain == 0 else hashlib.sha256((i - 1).to_bytes(8, "little")).digest()
            stamps.append((writer.write(0, key, parent, payload), t0 + (i * 7919 % stop) * 1000))  # scattered last-use times
    for path, stamp in stamps:
        os.utime(path, ns=(stamp, stamp))


def measure(store: PageStore) -> dict[str, float]:
    out: dict[str, float] = {}
    shutil.rmtree(store.private / ev.INDEX_DIR, ignore_errors=True)
    t = time.perf_counter()
    ev.scan_store(store)
    out["index_cold_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table = ev.scan_store(store)
    out["index_warm_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rows = ev.select_victims(table, table.total_bytes // 10)
    out["pick_s"] = time.perf_counter() - t
    t = time.perf_counter()
    done = ev.remove_chunks(store, table, rows)
    out["remove_s"] = time.perf_counter() - t
    out["removed"] = done.removed
    t = time.perf_counter()
    ev.scan_store(store)
    out["rescan_s"] = time.perf_counter() - t
    out["chunks"] = len(table)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/bench_eviction.py", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20000,100000", help="comma-separated chunk counts (ascending)")
    ap.add_argument("--chain", type=int, default=32, help="blocks per chain")
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="one JSON object per size instead of a table")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    base = args.dir or tempfile.mkdtemp(prefix="gdskv-bench-evict-")
    root = os.path.join(base, "store")
    spec = NamespaceSpec("bench/evict", "uint8", 16, (GroupSpec(0, PAGE_BYTES, (0,)),))
    try:
        store = PageStore.open(root)
        have = 0
        if not args.json:
            print(f"{'chunks':>9} {'write s':>8} {'index cold s':>13} {'index warm s':>13} {'pick s':>7} {'remove s':>9} {'removed':>8} {'rescan s':>9}")
        for n in sizes:
            t = time.perf_counter()
            grow(store, spec, have, n, args.chain)
            write_s = time.perf_counter() - t
            os.sync()  # timings below should not pay for the writeback of what was just written
            have = n
            r = measure(store)  # removes 10%: the next size is reached by new chunks on top
            r["write_s"] = write_s
            if args.json:
                print(json.dumps(r))
            else:
                print(f"{r['chunks']:>9} {write_s:>8.1f} {r['index_cold_s']:>13.2f} {r['index_warm_s']:>13.2f} {r['pick_s']:>7.2f} "
                      f"{r['remove_s']:>9.2f} {r['removed']:>8} {r['rescan_s']:>9.2f}")
            sys.stdout.flush()
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
