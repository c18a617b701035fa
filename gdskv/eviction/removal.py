"""Eviction removal: ``remove_chunks`` / ``remove_chunk``.

Every file operation goes through ``store.fs`` (confined to the store's root). A chunk is renamed
to a doomed temp name first, then removed only if no lease landed on it before the rename (a
lease after it fails, so the lookup promises nothing).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from array import array
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

import numpy as np

from gdskv import format as fmt
from gdskv.eviction.journal import REMOVE, TOUCH, journal_of, records
from gdskv.eviction.policy import ArrayRef, ChunkTable, leased
from gdskv.store import Namespace, PageStore

log = logging.getLogger(__name__)


@dataclass
class Removal:
    """What ``remove_chunks`` did. ``freed_bytes`` includes chunks another process removed first.
    ``skipped_leased``: chunks a lookup leased after the scan (kept, with their ancestors);
    ``skipped_fresh``: chunks used or published again after the ranking (kept likewise).
    ``freed_rows``: the ranked table's rows of the removed and gone chunks, which
    ``Budget.evict`` leaves out of its next ranking (``ChunkTable.without``); 8 bytes a row,
    since ``gdskv evict`` may remove millions."""

    removed: int = 0
    removed_bytes: int = 0
    skipped_pinned: int = 0
    already_gone: int = 0
    freed_bytes: int = 0
    failed: int = 0
    skipped_leased: int = 0
    skipped_fresh: int = 0
    freed_rows: array = field(default_factory=lambda: array("q"), repr=False)

    def __add__(self, other: "Removal") -> "Removal":
        """Both removals' counts summed (``Budget.evict``'s rounds); ``freed_rows`` name rows of
        the table each one ranked, so the sum has none."""
        return Removal(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                          if f.name != "freed_rows"})


_doomed_seq = itertools.count()


def _doomed_name(rel: str) -> str:
    """A temp name beside the chunk for its last moment: ``<lo>.tmp.<pid>.evict<n>``, which
    ``gdskv gc`` collects as this process's temp file should it die right here."""
    return f"{rel}{fmt.TMP_MARK}{os.getpid()}.evict{next(_doomed_seq)}"


def remove_chunk(store: PageStore, rel: str, ranked_mtime_ns: Optional[int] = None) -> str:
    """Remove one chunk file unless a lease vetoes it; ``"removed"``, ``"gone"``, ``"leased"``,
    ``"fresh"`` or ``"failed"``. Every step goes through ``store.fs`` (a link is moved or removed
    as itself).

    The chunk is first renamed to a doomed temp name in its own directory, so no lease can land
    on it by name any more (``Namespace.lease_many`` then fails, and the lookup promises nothing),
    then ``lstat``-ed: an atime in the future means a lease landed before the rename, and the
    chunk goes back under its name (``link_noreplace``: a chunk published there meanwhile wins)
    and stays. So does a chunk whose mtime is newer than ``ranked_mtime_ns``, the last use the
    ranking saw (``"fresh"``): used or published again since the index or the walk the choice
    came from, it is not the chunk that was chosen. Called by ``remove_chunks``."""
    return _remove_chunk(store, rel, ranked_mtime_ns)[0]


def _remove_chunk(store: PageStore, rel: str, ranked_mtime_ns: Optional[int]) -> tuple[str, Optional[os.stat_result]]:
    """``remove_chunk``, with the chunk's ``lstat`` when it was kept."""
    fs = store.fs
    doomed = _doomed_name(rel)
    try:
        fs.rename(rel, doomed)
    except FileNotFoundError:
        return "gone", None
    except OSError as e:
        log.warning("gdskv: could not evict %s: %s", fs.abspath(fs.rel(rel)), e)
        return "failed", None
    try:
        st = fs.lstat(doomed)
    except FileNotFoundError:  # another process's gc or eviction took it
        return "gone", None
    except OSError as e:
        st = None
        log.warning("gdskv: could not check the lease of %s: %s", fs.abspath(fs.rel(rel)), e)
    try:
        if st is None or leased(st.st_atime_ns, time.time_ns()):
            why = "leased"  # (or unknown)
        elif ranked_mtime_ns is not None and st.st_mtime_ns > ranked_mtime_ns:
            why = "fresh"
        else:
            fs.unlink(doomed)
            return "removed", None
        try:  # put it back
            fs.link_noreplace(doomed, rel)
        except FileExistsError:  # a save published the block again meanwhile: that one stays
            pass
        except OSError:
            fs.rename(doomed, rel)
            return why, st
        fs.unlink(doomed)
        return why, st
    except FileNotFoundError:
        return "gone", None
    except OSError as e:
        log.warning("gdskv: could not finish evicting %s (left as %s): %s", fs.abspath(fs.rel(rel)), doomed, e)
        return "failed", None


def remove_chunks(store: PageStore, table: ChunkTable, rows: Sequence[int],
                  is_pinned: Callable[[str], bool] = lambda path: False, lock: Optional[threading.Lock] = None) -> Removal:
    """Remove the chunk files of ``rows`` in the order given (descendants first, as ranked).

    A row whose file became pinned after it was chosen is kept, and so are its ancestors (they
    come later in ``rows``); so is one a lookup leased after the scan (``remove_chunk``).
    ``is_pinned`` is checked and the file removed under ``lock`` (the lock ``Budget.pin``
    takes), so a load either keeps its chunk or finds it gone (a miss). Counts ``evicted`` /
    ``evicted_bytes`` on the chunk's namespace (none for a damaged one). A row whose file was
    used after the ranking (newer mtime than ``table.mtime_ns``) is kept like a leased one.
    Journals what it finds (``gdskv.eviction.journal``: removed and gone chunks, the true mtime
    of fresh ones) so that the chunk index follows, one record as each chunk is done: a process
    killed mid-eviction leaves the index wrong by at most the chunk it was removing.
    Called by ``Budget`` and ``gdskv evict``.
    """
    out = Removal()
    keep: set[int] = set()
    counted: dict[str, Optional[Namespace]] = {}
    journal = journal_of(store)
    for row in (int(r) for r in rows):
        if row in keep:
            out.skipped_pinned += 1
            continue
        ref = table.arrays[int(table.array[row])]
        index = int(table.index[row])
        nbytes = int(table.nbytes[row])
        at = time.time_ns()  # before the rename: a save that publishes the block after it wins
        st: Optional[os.stat_result] = None
        with lock or contextlib.nullcontext():
            if is_pinned(ref.chunk_file(index)):
                status = "pinned"
            else:
                status, st = _remove_chunk(store, ref.chunk_rel(index), int(table.mtime_ns[row]))
        if status in ("removed", "gone"):
            journal.append(records(REMOVE, ref.ns_id, ref.group, np.uint64(index), at=at))
        elif st is not None:
            journal.append(records(TOUCH, ref.ns_id, ref.group, np.uint64(index), mtime=st.st_mtime_ns, lease=st.st_atime_ns, at=at))
        if status in ("pinned", "leased", "fresh"):
            if status == "pinned":
                out.skipped_pinned += 1
            elif status == "leased":
                out.skipped_leased += 1
            else:
                out.skipped_fresh += 1
            up = int(table.parent[row])
            while up >= 0 and up not in keep:
                keep.add(up)
                up = int(table.parent[up])
        elif status == "failed":
            out.failed += 1
        elif status == "gone":
            out.already_gone += 1
            out.freed_bytes += nbytes
            out.freed_rows.append(row)
        else:
            out.freed_rows.append(row)
            out.removed += 1
            out.removed_bytes += nbytes
            out.freed_bytes += nbytes
            if ref.ns_id not in counted:
                counted[ref.ns_id] = _counting_namespace(store, ref)
            ns = counted[ref.ns_id]
            if ns is not None:
                ns.counters.add("evicted")
                ns.counters.add("evicted_bytes", nbytes)
    return out


def _counting_namespace(store: PageStore, ref: ArrayRef) -> Optional[Namespace]:
    """The registered namespace of ``ref`` (so ``flush_stats`` writes its counts); None for a
    damaged namespace or when it cannot be registered."""
    if ref.namespace is None:
        return None
    try:
        return store.namespace(ref.namespace.spec)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("gdskv: eviction counts of namespace %s are not kept: %s", ref.ns_id, e)
        return None
