"""The TensorRT-LLM worker's transfers in flight, per request: settling them for ``get_finished``.

``GdsKvWorker`` keeps one map per kind, by request id (loads in the forward pass: futures;
asynchronous loads: a ``PacedLoad``; saves: futures) and settles them here at every
``get_finished``; a request leaves its map as soon as nothing of that kind is in flight for it,
so no entry outlives its transfers. Also the worker's outcome counters (``WorkerCounters``).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from gdskv.service.paced import PacedLoad
from gdskv.transfer import LoadStatus

log = logging.getLogger(__name__)


@dataclass
class WorkerCounters:
    """Outcomes of this worker's transfers."""

    loads_posted: int = 0
    loads_loaded: int = 0
    loads_failed: int = 0
    saves_posted: int = 0
    saves_published: int = 0
    saves_existing: int = 0
    saves_dropped: int = 0
    saves_suppressed: int = 0
    """Saves not posted because a load of the request failed (its KV is not trusted)."""

    @classmethod
    def of(cls, service: Any, suppressed: int) -> "WorkerCounters":
        """The counters of a worker's ``service`` (None: all zero) and its suppressed saves."""
        done = service.snapshot() if service is not None else {}
        names = [n for n in cls.__dataclass_fields__ if n != "saves_suppressed"]
        return cls(**{n: done.get(n, 0) for n in names}, saves_suppressed=suppressed)


def settle(inflight: dict[int, list[Future]], what: Optional[str]) -> None:
    """Drop finished futures (logging a failed ``what`` once) and requests with none left."""
    for rid in list(inflight):
        pending = []
        for fut in inflight[rid]:
            if not fut.done():
                pending.append(fut)
            elif what is not None and fut.exception() is not None:
                log.warning("gdskv: a %s failed: %s", what, fut.exception())
        if pending:
            inflight[rid] = pending
        else:
            del inflight[rid]


def settle_loads(inflight: dict[int, PacedLoad]) -> list[tuple[int, int, int]]:
    """Take the requests whose asynchronous loads have all finished out of ``inflight``; for
    each one with a page that did not come back ``LOADED`` (failed, cancelled, never posted),
    ``(request id, failed loads, loads)``."""
    failed = []
    for rid, load in list(inflight.items()):
        if not load.done:
            continue
        del inflight[rid]
        futures = load.futures
        bad = sum(1 for f in futures if f is None or f.cancelled() or f.exception() is not None or f.result() is not LoadStatus.LOADED)
        if bad:
            failed.append((rid, bad, len(futures)))
    return failed
