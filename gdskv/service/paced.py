"""A long asynchronous load posted a slice at a time: ``PacedLoad``.

Posting a page costs Python work (its segments, its future, its hand-off to the transfer):
about 25 us, so a 32k-token prefix of 512 pages posted at once is a 13 ms stall of the serving
loop in the step that admits the request, while the disk can only take the first
``io_threads`` of them anyway. A ``PacedLoad`` posts one slice when it starts (or, with
``start_at=k``, at its k-th ``pump``) and one more at each ``pump`` (the serving loop calls
it at every step's start and end) while fewer than a slice are unfinished, so each step pays for
the pages the disk finished since, not for the whole prefix. Should every posted page finish
between two pumps (steps longer than the disk needs for a slice), whoever finishes the last of
them posts the next slice: on the native path that is the serving loop's ``KvService.reap``,
or the transfer's reaper thread once a finished slice went uncollected ``REAP_GRACE``. Slices
are not posted from transfer threads otherwise: Python work there competes with the serving
thread for the interpreter (measured: decode steps 1.6-2x slower while a load posted its
slices from completions).

Used by the TensorRT-LLM worker for the loads it runs outside the batch
(``StepMetadata.async_loads``): nothing waits for them in the forward pass.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from gdskv.layout import KvCacheLayout
from gdskv.transfer import page_segments

if TYPE_CHECKING:
    from gdskv.service.core import KvService

log = logging.getLogger(__name__)

PACE_SLICE = 32
"""Pages of a paced load posted at once; at most two slices are unfinished at a time."""

PostFn = Callable[[Sequence[tuple[int, Any]]], list[Optional[Future]]]
"""Posts ``(index, op)`` items and returns one future (or None: not posted) per item, in order."""


class PacedLoad:
    """One request's asynchronous load of ``ops``, posted through ``post`` a slice at a time.

    ``futures[i]`` is op ``i``'s future once posted (None before, and for an op whose post gave
    None or failed: a page not loaded). ``done`` is True once every op was posted and finished,
    or ``cancel`` (or a post that raised) stopped it and what was posted finished. Thread-safe.
    """

    def __init__(self, ops: Sequence[Any], post: PostFn, slice_pages: int = PACE_SLICE, start_at: int = 0) -> None:
        self._ops = list(ops)
        self._post = post
        self._slice = max(1, slice_pages)
        self._lock = threading.Lock()
        self.futures: list[Optional[Future]] = [None] * len(self._ops)
        self._next = 0
        self._unfinished = 0
        self._cancelled = False
        self._posting = False
        self._waits = max(0, start_at - 1)
        if start_at <= 0:
            self.pump()

    @property
    def done(self) -> bool:
        with self._lock:
            return self._unfinished == 0 and not self._posting and (self._cancelled or self._next >= len(self._ops))

    def cancel(self) -> None:
        """Post nothing more (the request was aborted); what is in flight finishes."""
        with self._lock:
            self._cancelled = True

    def pump(self) -> None:
        """Post the next slice if fewer than a slice of pages are unfinished. Called by the
        serving loop (the worker's ``start_load_kv`` and ``get_finished``)."""
        with self._lock:
            if self._waits:
                self._waits -= 1
                return
            if self._posting or self._cancelled or self._next >= len(self._ops) or self._unfinished >= self._slice:
                return
            start = self._next
            stop = self._next = min(len(self._ops), start + self._slice)
            self._posting = True
        try:
            futures: Optional[list[Optional[Future]]] = self._post([(i, self._ops[i]) for i in range(start, stop)])
        except Exception as e:  # never into the serving loop or a transfer thread: the rest is a miss
            log.warning("gdskv: an asynchronous load could not be posted (%d pages left unloaded): %s",
                        len(self._ops) - start, e)
            futures = None
        with self._lock:
            self._posting = False
            if futures is None:
                futures, self._cancelled = [], True
            live = [(start + k, f) for k, f in enumerate(futures) if f is not None]
            self._unfinished += len(live)
            for i, f in live:
                self.futures[i] = f
        for _, f in live:
            f.add_done_callback(self._finished)

    def _finished(self, _: Future) -> None:
        with self._lock:
            self._unfinished -= 1
            dry = self._unfinished == 0
        if dry:  # the disk ran out of posted pages before the serving loop came back
            self.pump()


def post_pages(service: "KvService", layout: KvCacheLayout, items: Sequence[tuple[int, tuple[int, Any]]],
               ready: Any = None) -> list[Optional[Future]]:
    """A ``PostFn`` for planner load ops: ``(index, (layer group id, LoadOp))`` items posted
    through ``service.load_many`` group by group, into the ops' page slots of ``layout``,
    after ``ready`` as background loads (no forward pass waits for them); one future per item,
    in item order."""
    out: list[Optional[Future]] = [None] * len(items)
    by_group: dict[int, list[int]] = {}
    for k, (_, (gid, _op)) in enumerate(items):
        by_group.setdefault(gid, []).append(k)
    for gid, ks in by_group.items():
        group = layout.group(gid)
        pages = [(op.key, page_segments(group, op.page_slot)) for op in (items[k][1][1] for k in ks)]
        for k, fut in zip(ks, service.load_many(gid, pages, ready=ready, background=True)):
            out[k] = fut
    return out
