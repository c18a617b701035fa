#!/usr/bin/env python3
"""Cost of ``Namespace.contains_many`` as the store grows: microseconds per key.

    python scripts/bench_lookup.py [--dir DIR] [--max 100000] [--keys 1000,4000] [--json]

Grows one namespace (64-byte pages: lookup cost does not depend on page size) to 10k, 100k, ...
chunks, up to ``--max`` (``--max 1000000`` for the full run, a few minutes and ~1M inodes), and at
each size times ``contains_many`` for batches of keys that are all present, all absent, and half
and half. Chunks are published through the transfer layer's one chunk writer
(``gdskv.bench.ChunkWriter``: ``PageTransfer.save_page``, many in flight). Metadata is warm
(dentries and inodes cached), as in a serving process that looks up the same store continually.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdskv.bench import ChunkWriter, sigterm_as_exit  # noqa: E402
from gdskv.store import GroupSpec, Namespace, NamespaceSpec, PageStore  # noqa: E402

PAGE_BYTES = 64
GROUP = 0


def grow(ns: Namespace, keys: list[bytes]) -> None:
    """Publish a valid chunk (a payload of zeros) for each key."""
    payload = bytes(PAGE_BYTES)
    with ChunkWriter(ns) as writer:
        for key in keys:
            writer.write(GROUP, key, None, payload)


def time_lookup(ns: Namespace, keys: list[bytes], expect_hits: int, repeats: int) -> float:
    """Median microseconds per key of ``contains_many(keys)``."""
    per_key = []
    for _ in range(repeats):
        start = time.perf_counter()
        found = ns.contains_many(GROUP, keys)
        per_key.append((time.perf_counter() - start) / len(keys) * 1e6)
        if sum(found) != expect_hits:
            raise RuntimeError(f"contains_many found {sum(found)} of {len(keys)} keys, expected {expect_hits}")
    return statistics.median(per_key)


def sizes_up_to(maximum: int) -> list[int]:
    sizes, size = [], 10_000
    while size <= maximum:
        sizes.append(size)
        size *= 10
    return sizes or [maximum]


def run(directory: str, maximum: int, batch_sizes: Sequence[int], repeats: int,
        log: Optional[Any] = None) -> list[dict[str, Any]]:
    """Grow a fresh store step by step and time lookups at each size; the rows of the report."""
    rng = random.Random(0)
    base = Path(tempfile.mkdtemp(prefix="gdskv-lookup-", dir=directory))
    rows: list[dict[str, Any]] = []
    try:
        store = PageStore.open(base / "store")
        ns = store.namespace(NamespaceSpec(model="gdskv-bench-lookup", dtype="uint8", tokens_per_block=1,
                                           groups=(GroupSpec(GROUP, PAGE_BYTES, (0,), None),)))
        stored: list[bytes] = []
        for size in sizes_up_to(maximum):
            start = time.perf_counter()
            new = [rng.randbytes(32) for _ in range(size - len(stored))]
            grow(ns, new)
            stored.extend(new)
            if log:
                log(f"store grown to {size} chunks in {time.perf_counter() - start:.1f} s")
            for batch in batch_sizes:
                present = rng.sample(stored, min(batch, len(stored)))
                absent = [rng.randbytes(32) for _ in range(batch)]
                half = present[: batch // 2] + absent[: batch - batch // 2]
                rng.shuffle(half)
                rows.append({
                    "chunks": size, "keys": batch,
                    "us_per_key_all_present": time_lookup(ns, present, len(present), repeats),
                    "us_per_key_all_absent": time_lookup(ns, absent, 0, repeats),
                    "us_per_key_half": time_lookup(ns, half, batch // 2, repeats),
                })
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="directory on the disk to measure (default: the system temp directory)")
    parser.add_argument("--max", type=int, default=100_000, help="largest store, in chunks (default 100000)")
    parser.add_argument("--keys", default="1000,4000", help="batch sizes, comma-separated (default 1000,4000)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure; the median is shown")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    batches = [int(k) for k in args.keys.split(",") if k]
    rows = run(args.dir, args.max, batches, args.repeats, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'chunks':>9} {'keys':>6} {'us/key present':>15} {'us/key absent':>14} {'us/key half':>12}")
    for r in rows:
        print(f"{r['chunks']:>9} {r['keys']:>6} {r['us_per_key_all_present']:>15.2f} "
              f"{r['us_per_key_all_absent']:>14.2f} {r['us_per_key_half']:>12.2f}")
    return 0


if __name__ == "__main__":
    with sigterm_as_exit():
        sys.exit(main())
