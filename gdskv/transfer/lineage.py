"""The saves a ``PageTransfer`` has on their way: what it tells the budget about a save's parent.

``PageTransfer.save_pages`` posts a step's saves here, its bookkeeping forgets each when it
finishes, and a budget refusal counts against its copy at once; ``Budget.admit`` asks
``lineage`` (through ``PageTransfer._admit``) once it may evict. A chain saved in one step on a
full store then evicts for every block, keeping the blocks above it, not only for the ones whose
parent has landed.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

from gdskv.transfer.pages import SaveStatus

Forget = Callable[[list[int], Optional[list[Any]], list[int]], None]


class SavesOnTheirWay:
    """Per layer group, every block posted and not finished: its parent, the copies of it on
    their way (two requests of a step may post the same block) and how many of those the budget
    refused. Called from the serving thread (``post``) and the transfer threads (the rest)."""

    def __init__(self) -> None:
        self._groups: dict[int, dict[bytes, list]] = {}  # key -> [parent, copies, refused]
        self._lock = threading.Lock()

    def post(self, group: int, jobs: Sequence[tuple]) -> Forget:
        """Note saves ``(key, parent, ...)`` as on their way; the returned function, given a
        batch's ``(done, results, skipped)`` indices into ``jobs``, forgets those copies."""
        with self._lock:
            saving = self._groups.setdefault(group, {})
            for job in jobs:
                saving.setdefault(job[0], [job[1], 0, 0])[1] += 1

        def forget(done: list[int], results: Optional[list[Any]], skipped: list[int]) -> None:
            with self._lock:
                for i, k in enumerate(done):
                    _forget(saving, jobs[k][0], results[i] is SaveStatus.DROPPED if results else True)
                for k in skipped:
                    _forget(saving, jobs[k][0], False)

        return forget

    def refused(self, group: int, key: bytes) -> None:
        """One copy of ``key`` was refused by the budget: it is no longer on its way from now,
        not only once its slice is done, so that a child later in the slice is not admitted, and
        evicted for, as if its parent would land."""
        with self._lock:
            entry = self._groups.get(group, {}).get(key)
            if entry is not None:
                entry[2] += 1

    def lineage(self, group: int, parent: Optional[bytes]) -> tuple[Optional[bytes], list[bytes]]:
        """``(stored, saving)`` for a save's ``Budget.admit``: the parent and its ancestors still
        on their way (nearest first), and the block above them, which must be stored already."""
        saving: list[bytes] = []
        with self._lock:
            posted = self._groups.get(group, {})
            while parent is not None and len(saving) <= len(posted):
                entry = posted.get(parent)
                if entry is None or entry[1] <= entry[2]:
                    break  # not posted, or every copy of it refused
                saving.append(parent)
                parent = entry[0]
        return parent, saving

    def __len__(self) -> int:
        """Blocks on their way, all groups together."""
        with self._lock:
            return sum(len(saving) for saving in self._groups.values())


def _forget(saving: dict[bytes, list], key: bytes, dropped: bool) -> None:
    """One finished copy of ``key`` (under the lock): ``dropped`` (or its slice failed) settles
    one refusal of it, if any was counted."""
    entry = saving.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if dropped and entry[2]:
        entry[2] -= 1
    if entry[1] <= 0:
        del saving[key]
