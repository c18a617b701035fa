"""Publishing intents (``gdskv.eviction.intents``): a save journals its chunks before it renames
them; an intent counts for nothing while its writer lives and holds its journal, and is settled by
a look at its file once the writer is gone (or the intent is old): what ``test_index_crash`` needs
from a process killed mid-save, here with a journal lock held and let go by hand."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch

from gdskv.config import GdsKvConfig
from gdskv.eviction import catalog, install_budget, scan_store
from gdskv.eviction.index import chunk_index_of
from gdskv.eviction.journal import INTENT, JOURNAL_DIR, PUBLISH, RECORD, REMOVE, records
from gdskv.io.posix import PosixEngine
from gdskv.keys import chain_keys
from gdskv.store import GroupSpec, NamespaceSpec, PageStore
from gdskv.transfer import PageTransfer, SaveStatus

PAGE = 4096
TPB = 2
BUDGET = 1 << 40


def _spec(model: str) -> NamespaceSpec:
    return NamespaceSpec(model, "uint8", TPB, (GroupSpec(0, PAGE, (0,)),))


def _walk(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    """Chunks and bytes per array, by a walk of the chunk files (the truth)."""
    t = scan_store(store, with_parents=False)
    return {(ref.ns_id, ref.group): (int((t.array == i).sum()), int(t.nbytes[t.array == i].sum()))
            for i, ref in enumerate(t.arrays) if (t.array == i).any()}


def _indexed(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    return {k: v for k, v in catalog.totals(store).per_array.items() if v[0]}


def _journal(root: Path, pid: int) -> list[np.ndarray]:
    """Every whole record of the journals of process ``pid``, per file."""
    out = []
    for j in sorted((root / JOURNAL_DIR).iterdir()):
        if j.name.rsplit("-", 3)[1] == str(pid):
            data = j.read_bytes()
            out.append(np.frombuffer(data[: len(data) - len(data) % RECORD.itemsize], dtype=RECORD))
    return out


def test_a_steps_saves_journal_their_intents_before_their_renames(tmp_path: Path) -> None:
    """Intent records name each chunk (and its parent and size) before the publish records, in one
    batch per step; once published, nothing is left in flight to carry into the snapshot."""
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec("intents/order"))
    install_budget(store, GdsKvConfig(store_path=str(root), max_bytes=BUDGET))
    xfer = PageTransfer(ns, PosixEngine(threads=2), threads=2)
    try:
        keys = chain_keys(list(range(16)), TPB)
        page = torch.zeros(PAGE, dtype=torch.uint8)
        futures = xfer.save_pages(0, [(k, keys[i - 1] if i else None, [page]) for i, k in enumerate(keys)])
        assert [f.result() for f in futures] == [SaveStatus.PUBLISHED] * len(keys)
    finally:
        xfer.close()
    recs = np.concatenate(_journal(root, os.getpid()))
    intents, published = recs[recs["kind"] == INTENT], recs[recs["kind"] == PUBLISH]
    want = [chunk_index_of(ns.id, 0, k) for k in keys]
    assert sorted(intents["index"].tolist()) == sorted(published["index"].tolist()) == sorted(want)
    assert set(intents["nbytes"].tolist()) == {ns.chunk_nbytes(0)}
    assert intents["parent"].tolist() == published["parent"].tolist()
    assert intents["at"].max() <= published["at"].min()
    catalog.compact(store)
    assert json.loads((root / catalog.CATALOG).read_text())["intents"] == {}
    assert _indexed(store) == _walk(store)


def test_an_intent_is_in_flight_while_its_writer_holds_its_journal_then_settled_by_its_file(tmp_path: Path) -> None:
    """Another process's intents (its journal locked as ``Journal`` locks it): neither counted nor
    looked at while young, carried through a fold; once the lock is free (its writer died), the
    next count looks at each file once: the chunk that was renamed counts, the one that never
    appeared does not. An intent older than ``INTENT_TTL_S`` is looked at even while locked."""
    root = tmp_path / "store"
    store = PageStore.open(root)
    ns = store.namespace(_spec("intents/flight"))
    assert install_budget(store, GdsKvConfig(store_path=str(root), max_bytes=BUDGET)).counted.wait(10)
    other = PageTransfer(PageStore.open(root).namespace(_spec("intents/flight")), PosixEngine(threads=1), threads=1)
    page = torch.zeros(PAGE, dtype=torch.uint8)
    renamed, never, stale = chain_keys(list(range(6)), TPB)
    try:  # a store object without a budget journals nothing: its save is a rename the index never heard of
        assert other.save_page(0, renamed, None, [page]).result() is SaveStatus.PUBLISHED
        assert other.save_page(0, stale, None, [page]).result() is SaveStatus.PUBLISHED
    finally:
        other.close()
    name = f"{socket.gethostname()}-{os.getppid()}-1-0.log"  # a live process's name, never this one's
    nbytes, now = ns.chunk_nbytes(0), time.time_ns()
    (root / JOURNAL_DIR).mkdir(parents=True, exist_ok=True)
    writer = os.open(root / JOURNAL_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    fcntl.flock(writer, fcntl.LOCK_EX)
    try:
        os.write(writer, np.concatenate([
            records(INTENT, ns.id, 0, np.array([chunk_index_of(ns.id, 0, k) for k in (renamed, never)], np.uint64),
                    nbytes=nbytes, at=now),
            records(INTENT, ns.id, 0, np.uint64(chunk_index_of(ns.id, 0, stale)), nbytes=nbytes, at=now - 61 * 10**9)]).tobytes())
        walk = _walk(store)
        assert walk == {(ns.id, 0): (2, 2 * nbytes)}
        assert _indexed(store) == {(ns.id, 0): (1, nbytes)}  # the stale one, looked at while its writer lives
        catalog.compact(store)
        carried = json.loads((root / catalog.CATALOG).read_text())["intents"]
        assert sorted(row[2] for row in carried[name]) == sorted(chunk_index_of(ns.id, 0, k) for k in (renamed, never))
        assert _indexed(store) == {(ns.id, 0): (1, nbytes)}
    finally:
        os.close(writer)  # its writer is gone
    assert _indexed(store) == walk
    settled = np.concatenate(_journal(root, os.getpid()))
    settled = settled[np.isin(settled["kind"], (PUBLISH, REMOVE))]
    assert sorted(zip(settled["kind"].tolist(), settled["index"].tolist())) == sorted(
        [(PUBLISH, chunk_index_of(ns.id, 0, stale)), (PUBLISH, chunk_index_of(ns.id, 0, renamed)),
         (REMOVE, chunk_index_of(ns.id, 0, never))])
    assert _indexed(store) == walk  # settled for good: nothing is looked at twice
    assert len(np.concatenate(_journal(root, os.getpid()))) == len(settled)
    catalog.compact(store)
    assert json.loads((root / catalog.CATALOG).read_text())["intents"] == {}
    assert _indexed(store) == walk
