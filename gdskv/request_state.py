"""Per-request state a connector's scheduler keeps, bounded in time: ``RequestTable``.

A scheduler learns of a request at its lookup (``get_num_new_matched_tokens``) and forgets it when
the engine says it finished or was aborted (``request_finished``). A request that was looked up
but never scheduled (cancelled, rejected, or looked up again under a new id) would otherwise stay
for ever; the table drops such an entry once ``unscheduled_ttl_s`` has passed since its lookup
without the engine scheduling it (``mark_scheduled``: pages were allocated for it, or it was
reported in a step). Scheduled requests stay until ``pop``.

Who calls what: the TensorRT-LLM and vLLM scheduler halves (``gdskv.connectors``) ``put`` at the
lookup, ``mark_scheduled`` at the allocation and first report, ``pop`` at finish / abort / preemption,
and ``expire`` once per step (``build_connector_meta``). Not thread-safe: a scheduler's callbacks
come from one thread.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, Optional, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

DEFAULT_UNSCHEDULED_TTL_S = 30.0
"""How long a looked-up request may wait to be scheduled before its entry is dropped: the lease its
lookup took on the store's chunks lasts as long (``gdskv.service.LEASE_SECONDS``), so after that
its promise is no longer backed anyway. A request scheduled later still runs: it is then planned
as one without a lookup (its blocks are saved, nothing is loaded)."""


class RequestTable(Generic[K, V]):
    """A dict of request id -> state, where unscheduled entries expire.

    ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, unscheduled_ttl_s: float = DEFAULT_UNSCHEDULED_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not unscheduled_ttl_s > 0:
            raise ValueError(f"unscheduled_ttl_s must be > 0, got {unscheduled_ttl_s!r}")
        self.unscheduled_ttl_s = unscheduled_ttl_s
        self._clock = clock
        self._states: dict[K, V] = {}
        self._unscheduled: OrderedDict[K, float] = OrderedDict()
        """Ids not yet scheduled -> when they were put, oldest first."""

    def put(self, rid: K, state: V, scheduled: bool = False) -> None:
        """Record (or replace) ``rid``'s state; unscheduled unless ``scheduled``."""
        self._states[rid] = state
        self._unscheduled.pop(rid, None)
        if not scheduled:
            self._unscheduled[rid] = self._clock()

    def mark_scheduled(self, rid: K) -> None:
        """The engine scheduled ``rid``: its entry now lives until ``pop``."""
        self._unscheduled.pop(rid, None)

    def get(self, rid: K) -> Optional[V]:
        return self._states.get(rid)

    def pop(self, rid: K) -> Optional[V]:
        """Forget ``rid`` (finished, aborted, preempted); its state, or None."""
        self._unscheduled.pop(rid, None)
        return self._states.pop(rid, None)

    def expire(self) -> list[K]:
        """Drop the entries unscheduled for longer than ``unscheduled_ttl_s``; their ids."""
        cutoff = self._clock() - self.unscheduled_ttl_s
        gone = []
        while self._unscheduled:
            rid, since = next(iter(self._unscheduled.items()))
            if since > cutoff:
                break
            del self._unscheduled[rid]
            self._states.pop(rid, None)
            gone.append(rid)
        return gone

    def __contains__(self, rid: object) -> bool:
        return rid in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._states))

    @property
    def unscheduled(self) -> int:
        """How many entries are waiting to be scheduled."""
        return len(self._unscheduled)
