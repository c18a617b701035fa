"""Links between block keys learnt from an engine that names its blocks itself (MAX).

``KvService.lineage`` is one ``Lineage``; the MAX connector teaches it each run of keys it shows
the service (lookups, touches, offloads) and asks it for the parent of an offload's first block.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

LINEAGE_CAPACITY = 1 << 16
"""How many ``block -> parent`` links ``KvService.lineage`` remembers."""


class Lineage:
    """Recent ``block key -> parent key`` links, for an engine that names its blocks itself and
    hands the service runs of them (MAX: root-anchored runs in ``lookup`` / ``touch``, offload
    runs whose first block comes with no parent). Learnt from each run; bounded (the least
    recently learnt link is forgotten first); thread-safe. ``KvService.lineage`` is one."""

    def __init__(self, capacity: int = LINEAGE_CAPACITY) -> None:
        self._parent: OrderedDict[bytes, bytes] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def learn(self, run: Sequence[bytes]) -> None:
        """Each key of ``run`` (in prefix order) is the parent of the next."""
        with self._lock:
            for parent, child in zip(run, run[1:]):
                self._parent[child] = parent
                self._parent.move_to_end(child)
            while len(self._parent) > self._capacity:
                self._parent.popitem(last=False)

    def parent_of(self, key: bytes) -> Optional[bytes]:
        """The parent last learnt for ``key``, or None."""
        with self._lock:
            return self._parent.get(key)
