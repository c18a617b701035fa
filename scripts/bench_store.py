#!/usr/bin/env python3
"""Store save/load GB/s against raw sequential I/O and torch.save files: ``gdskv.bench``.

    python scripts/bench_store.py [--dir DIR] [--total 1G] [--page-size 256K ...] [--pool torch|hugepage ...] [--peers vllm,lmcache] [--json]

``--driver-double`` (this script only, for development machines without a GPU) loads the test
double of the CUDA driver from ``tests/fakecuda`` first, so the kvikio engine runs in compat mode
and can be measured too; it is never used where a real ``libcuda.so.1`` opens.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_driver_double() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from fakecuda import ensure_libcuda

    print(f"libcuda: {ensure_libcuda()}", file=sys.stderr)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--driver-double" in args:
        args.remove("--driver-double")
        _load_driver_double()
    sys.path.insert(0, str(REPO))
    from gdskv.bench import main

    sys.exit(main(args))
