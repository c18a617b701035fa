"""``gdskv info`` counts from the chunk index: what serving processes without a byte budget saved
after the index was made must be in it. They journaled nothing, so ``info`` (and the metrics, and
every budgeted process's count) showed the store as it was when the index was made until the
daily walk: 12 chunks of a store holding 36."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SAVER = textwrap.dedent("""
    import sys, torch
    from gdskv.config import GdsKvConfig
    from gdskv.eviction import install_budget
    from gdskv.io.posix import PosixEngine
    from gdskv.keys import chain_keys
    from gdskv.store import GroupSpec, NamespaceSpec, PageStore
    from gdskv.transfer import PageTransfer

    root, first, chains = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = PageStore.open(root)
    ns = store.namespace(NamespaceSpec("test/no-budget", "uint8", 4, (GroupSpec(0, 256, (0,)),)))
    install_budget(store, GdsKvConfig(store_path=root))  # what the service does at bring-up; no limit set
    engine = PosixEngine(threads=2)
    xfer = PageTransfer(ns, engine, threads=2)
    for c in range(first, first + chains):
        keys = chain_keys([c * 1000 + t for t in range(16)], 4)
        pages = [(k, keys[i - 1] if i else None, [torch.full((256,), i, dtype=torch.uint8)]) for i, k in enumerate(keys)]
        assert all(f.result().name == "PUBLISHED" for f in xfer.save_pages(0, pages))
    xfer.close()
    engine.close()
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GDSKV_CONFIG", "GDSKV_STORE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _save(root: Path, first: int, chains: int) -> None:
    subprocess.run([sys.executable, "-c", SAVER, str(root), str(first), str(chains)], check=True, env=_env(), timeout=120)


def _info_chunks(root: Path) -> int:
    run = subprocess.run([sys.executable, "-m", "gdskv.cli.main", "--store", str(root), "info", "--json"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["chunks"]


def test_info_counts_what_processes_without_a_budget_saved_after_the_index_was_made(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _save(root, 0, 3)
    assert _info_chunks(root) == 12  # the first reading makes the index
    _save(root, 3, 6)  # another serving process, no budget, after the index exists
    walked = sum(len(files) for _, _, files in os.walk(root / "ns") if files and "zarr.json" not in files)
    assert walked == 36
    assert _info_chunks(root) == 36
