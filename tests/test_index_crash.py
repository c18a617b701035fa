"""A process killed with ``kill -9`` between a chunk's rename and its journal record: the chunks
it published but never journaled are in the chunk index at the next bring-up of any process on
the store, without a walk of the store (FORMAT.md, "The chunk index": publishing intents)."""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gdskv import eviction as ev
from gdskv.config import GdsKvConfig
from gdskv.eviction import catalog, install_budget, scan_store
from gdskv.eviction.journal import JOURNAL_DIR, PUBLISH, RECORD
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer

PAGE = 4096
TPB = 2
BATCH = 32
BUDGET = 1 << 40  # never reached: no eviction, so the files and the index must agree exactly
CTX = mp.get_context("forkserver")  # one interpreter that imported torch, forked once per saver


def _spec(model: str) -> NamespaceSpec:
    return NamespaceSpec(model, "uint8", TPB, (GroupSpec(0, PAGE, (0,)),))


def _saver(root: str, model: str, ready: Any) -> None:
    """A serving process's saves, as a connector makes them (budget installed, native batch
    path): chains of ``BATCH`` pages into its own namespace, one step after another, until it is
    killed. ``ready`` is set once its journal holds records."""
    store = PageStore.open(root)
    ns = store.namespace(_spec(model))
    install_budget(store, GdsKvConfig(store_path=root, max_bytes=BUDGET))
    xfer = PageTransfer(ns, PosixEngine(threads=2), threads=2)
    page = torch.zeros(PAGE, dtype=torch.uint8)
    for step in itertools.count():
        keys = chain_keys(list(range(step * 10 * BATCH, step * 10 * BATCH + TPB * BATCH)), TPB)
        for f in xfer.save_pages(0, [(k, keys[i - 1] if i else None, [page]) for i, k in enumerate(keys)]):
            f.result()
        ready.set()


def _journaled_by(root: Path, pid: int) -> set[int]:
    """Chunk indexes the process ``pid`` journaled as published, from its own journal files."""
    out: set[int] = set()
    for j in (root / JOURNAL_DIR).iterdir():
        if j.name.rsplit("-", 3)[1] == str(pid):
            data = j.read_bytes()
            recs = np.frombuffer(data[: len(data) - len(data) % RECORD.itemsize], dtype=RECORD)
            out |= set(recs["index"][recs["kind"] == PUBLISH].tolist())
    return out


def _walk(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    """Chunks and bytes per array, by a walk of the chunk files (the truth)."""
    t = scan_store(store, with_parents=False)
    return {(ref.ns_id, ref.group): (int((t.array == i).sum()), int(t.nbytes[t.array == i].sum()))
            for i, ref in enumerate(t.arrays) if (t.array == i).any()}


def test_chunks_a_killed_process_published_but_never_journaled_count_at_the_next_bring_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Savers killed mid-loop until the kills have left chunk files their process never journaled
    as published (each saver's own journals against its own array's files: the old code's hole);
    then a fresh budget counts exactly the files, without a walk."""
    root = tmp_path / "store"
    store = PageStore.open(root)
    CTX.set_forkserver_preload(["torch", "gdskv.transfer", "gdskv.eviction", "gdskv.io.posix", __name__])
    rng = random.Random(1)
    unjournaled = 0
    for kill in range(12):
        ready = CTX.Event()
        model = f"crash/{kill}"
        proc = CTX.Process(target=_saver, args=(str(root), model, ready))
        proc.start()
        assert ready.wait(60)
        time.sleep(rng.uniform(0.02, 0.2))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        on_disk = scan_store(store, [_spec(model).namespace_id], with_parents=False)
        unjournaled += len(set(on_disk.index.tolist()) - _journaled_by(root, proc.pid))
        if kill >= 2 and unjournaled:
            break
    # the test means something only where a kill landed after a rename and before its record
    assert unjournaled, "no kill landed between a chunk's rename and its journal record"
    truth = _walk(store)
    monkeypatch.setattr(ev.index, "_walk_array", lambda *a: pytest.fail("walked the store"))
    again = PageStore.open(root)  # the next bring-up, in a process that never saved anything
    budget = install_budget(again, GdsKvConfig(store_path=str(root), max_bytes=BUDGET))
    assert budget is not None and budget.counted.wait(10)
    assert {k: v for k, v in catalog.totals(again).per_array.items() if v[0]} == truth
    assert budget.used_bytes == sum(b for _, b in truth.values())
    rows, _, _ = catalog.read(again)
    assert len(rows) == sum(c for c, _ in truth.values())

