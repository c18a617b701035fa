"""Event counters of one namespace in this process (``Namespace.counters``): the transfer layer,
the service and the store count into them; ``PageStore.flush_stats`` writes them for ``gdskv
stats`` and ``gdskv.metrics``."""
from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Thread-safe event counters of one namespace in this process (hits, misses, bytes, ...)."""

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._c[name]
