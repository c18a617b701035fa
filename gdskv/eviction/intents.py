"""Publishing intents: the chunks a save is about to rename into place, journaled before the
rename, so that a process killed between a rename and its ``PUBLISH`` record leaves the chunk
index a file to look at instead of a chunk nobody counts until the next walk of the store.

A save journals ``INTENT`` records (chunk, parent, size; ``at`` before the rename) through
``Budget.on_publishing``, writes and renames, then journals ``PUBLISH`` as before. An intent is
*settled* by any ``PUBLISH`` or ``REMOVE`` of its chunk stamped at or after it. An unsettled intent
is *in flight* while its writer lives (it holds its journal's ``flock``: ``Journal``) and it is
younger than ``INTENT_TTL_S``; in flight, it counts for nothing (as a save in flight always did:
its own process reserves the bytes). Otherwise it is *due*: a reader of the index ``lstat``s the
chunk file and journals what it found (``PUBLISH`` with the file's size and mtime, or ``REMOVE``
when there is no file), which settles the intent for every reader. So a dead writer costs one
``lstat`` per chunk it had on its way (its saves in flight), at the next count of any process;
a clean store costs a lock probe per journal with saves in flight, never a walk.

Intents still in flight when the snapshot is rewritten (``catalog.write``) are carried in
``catalog.json`` (``intents``: per journal, ``[ns_id, group, index, parent, bytes, at]``), since
the snapshot's offsets pass them. Called by the catalog's readers (``catalog.read``, ``totals``)
and by ``rebuild_catalog``.
"""
from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from typing import Any

import numpy as np

from gdskv import format as fmt
from gdskv.eviction.journal import INTENT, JOURNAL_DIR, PUBLISH, RECORD, REMOVE, TOUCH, journal_of, records
from gdskv.eviction.policy import ArrayRef
from gdskv.store import NAMESPACE_ID, PageStore

INTENT_TTL_S = 60.0
"""How long an intent of a live writer stays in flight: past it, the save failed or hangs, and a
reader looks at the file (what it records is right whatever the save does next)."""

Pending = dict[str, np.ndarray]
"""Unsettled ``INTENT`` records by the name of the journal that holds them (its writer's)."""

_MAX_INDEX = np.uint64(1 << (fmt.HI_BITS + fmt.LO_BITS))


def split(each: dict[str, np.ndarray], carried: Pending) -> tuple[np.ndarray, Pending]:
    """``read_each``'s records as the records the catalog applies (``PUBLISH``/``TOUCH``/
    ``REMOVE`` of every journal, in one array) and the intents by journal, ``carried`` (the
    snapshot's) included."""
    parts = [r[np.isin(r["kind"], (PUBLISH, TOUCH, REMOVE))] for r in each.values()]
    pending = dict(carried)
    for name, r in each.items():
        mine = r[(r["kind"] == INTENT) & (r["index"] < _MAX_INDEX) & (r["group"] < (1 << 31))]  # as ``apply`` takes them
        if mine.size:
            pending[name] = np.concatenate([pending[name], mine]) if name in pending else mine
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD)), pending


def unsettled(pending: Pending, recs: np.ndarray) -> Pending:
    """The intents of ``pending`` that no ``PUBLISH``/``REMOVE`` of their chunk in ``recs``,
    stamped at or after them, settles. One sort of the intents and those records."""
    names = [n for n in pending if pending[n].size]
    if not names:
        return {}
    intents = np.concatenate([pending[n] for n in names])
    exist = recs[recs["kind"] != TOUCH]
    col = {k: np.concatenate([intents[k], exist[k]]) for k in ("ns", "group", "index", "at")}
    order = np.lexsort((col["at"], col["index"], col["group"], col["ns"]))  # ties in ``at``: the intent first
    s = {k: v[order] for k, v in col.items()}
    starts = np.r_[True, (s["ns"][1:] != s["ns"][:-1]) | (s["group"][1:] != s["group"][:-1]) | (s["index"][1:] != s["index"][:-1])]
    chunk = np.cumsum(starts) - 1
    last_exist = np.full(int(chunk[-1]) + 1, -1, dtype=np.int64)
    exist_at = np.nonzero(order >= intents.size)[0]
    last_exist[chunk[exist_at]] = exist_at  # later positions overwrite earlier ones: the last wins
    pos = np.empty(order.size, dtype=np.int64)
    pos[order] = np.arange(order.size)
    mine = pos[:intents.size]
    left = last_exist[chunk[mine]] < mine
    out: Pending = {}
    at = 0
    for name in names:
        n = pending[name].size
        if left[at:at + n].any():
            out[name] = pending[name][left[at:at + n]]
        at += n
    return out


def writer_alive(store: PageStore, name: str) -> bool:
    """Whether the process that writes the journal ``name`` still has it (holds its ``flock``):
    tried with a shared lock, never waited on. A journal that is gone is a dead writer's (only
    those are dropped). This process's own journals are alive without a probe: where a file
    system implements ``flock`` with POSIX locks, closing the probe would drop this process's
    own lock. A file system without locks says alive (its intents wait out ``INTENT_TTL_S``)."""
    parts = name.rsplit("-", 3)
    if len(parts) == 4 and parts[0] == socket.gethostname() and parts[1] == str(os.getpid()):
        return True
    try:
        fd = store.fs.open_regular(f"{JOURNAL_DIR}/{name}")
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:  # BlockingIOError: held
        return True
    finally:
        os.close(fd)


def settle(store: PageStore, pending: Pending) -> tuple[np.ndarray, Pending]:
    """Settle the due intents of ``pending`` (unsettled ones: ``unsettled``) by their files: a
    regular file is ``PUBLISH``ed with its size and mtime (the intent's parent), anything else
    (nothing, a link, a directory) ``REMOVE``d, stamped before the look, so a save that publishes
    the chunk after it wins. The records are journaled (this process's journal), which settles
    the intents for every reader; returned, with the intents still in flight."""
    now = time.time_ns()
    due: list[np.ndarray] = []
    flying: Pending = {}
    for name, recs in pending.items():
        young = now - recs["at"] < INTENT_TTL_S * 1e9
        if young.any() and writer_alive(store, name):
            flying[name] = recs[young]
            recs = recs[~young]
        due.append(recs)
    todo = np.concatenate(due) if due else np.zeros(0, dtype=RECORD)
    if todo.size == 0:
        return todo, flying
    out = np.zeros(todo.size, dtype=RECORD)
    for col in ("ns", "group", "index", "parent"):
        out[col] = todo[col]
    out["kind"], out["at"] = REMOVE, time.time_ns()
    for i in range(todo.size):
        ref = ArrayRef(f"{int(todo['ns'][i]):016x}", int(todo["group"][i]), "")
        try:
            st = store.fs.lstat(ref.chunk_rel(int(todo["index"][i])))
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode):
            out["kind"][i], out["nbytes"][i], out["mtime"][i] = PUBLISH, st.st_size, st.st_mtime_ns
    journal_of(store).append(out)
    return out, flying


def to_json(pending: Pending) -> dict[str, list[list[Any]]]:
    """``pending`` as ``catalog.json`` carries it."""
    return {name: [[f"{int(r['ns']):016x}", int(r["group"]), int(r["index"]), int(r["parent"]), int(r["nbytes"]), int(r["at"])]
                   for r in recs] for name, recs in pending.items() if recs.size}


def from_json(doc: Any) -> Pending:
    """``catalog.json``'s ``intents`` (absent: none); ``ValueError`` (or ``KeyError``,
    ``TypeError``) for one that is not as ``to_json`` writes it."""
    out: Pending = {}
    for name, rows in dict(doc or {}).items():
        if not isinstance(name, str) or "/" in name or not name.endswith(".log") or name.startswith("."):
            raise ValueError(f"intents of a journal named {name!r}")
        parts = []
        for ns_id, group, index, parent, nbytes, at in rows:
            if not NAMESPACE_ID.match(str(ns_id)) or not 0 <= int(group) < (1 << 31):
                raise ValueError(f"an intent for array {ns_id!r} g{group!r}")
            try:
                parts.append(records(INTENT, str(ns_id), int(group), np.uint64(int(index)), np.uint64(int(parent)),
                                     int(nbytes), at=int(at)))
            except OverflowError:
                raise ValueError(f"an intent out of range: {[ns_id, group, index, parent, nbytes, at]!r}") from None
        if parts:
            out[name] = np.concatenate(parts)
    return out
