"""Futures for a batch of pages: ``PageFuture`` and ``resolve_many``.

A ``concurrent.futures.Future`` per page cost more Python than moving a warm 256 KiB page: its
``Condition`` (an ``RLock``, a deque, a Python object with bound methods) made per page, a lock
round trip in every ``result()``/``done()``, and five garbage-collected objects per page that
survive long enough to set off full collections (py-spy, warm 256 KiB loads through
``PageTransfer``: 37% of the GIL's samples were futures). ``PageFuture`` is a ``Future`` (every
method, ``isinstance``, ``concurrent.futures.wait``) whose batch shares one ``Condition``,
whose ``result``/``exception``/``done`` answer without the lock once it is finished, and which
``resolve_many`` settles a slice at a time under one lock acquisition.

Made by ``gdskv.transfer.PageTransfer._batch``; callers only see ``Future``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, TimeoutError
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING
from typing import Any, Callable, ContextManager, Optional, Sequence

_OVER = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)
_CANCELLED = (CANCELLED, CANCELLED_AND_NOTIFIED)


class _ListOnFirstUse:
    """A future's ``_waiters`` or ``_done_callbacks``: its own empty list, made when first read
    (then an ordinary attribute of the instance, and ``_lists`` set). Most page futures are
    only ever asked for their result, and two lists each, alive for the whole load, were two of
    the page's garbage-collected objects that set off full collections in a heap nobody froze."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self
        made: list = []
        setattr(obj, self.name, made)
        obj._lists = True
        return made


class PageFuture(Future):
    """A ``Future`` sharing ``condition`` with the other futures of its batch. A shared
    condition's ``notify_all`` wakes waiters of other pages too, so every wait here loops until
    this future is over (the base class would take such a wake-up for a timeout)."""

    _waiters = _ListOnFirstUse()
    _done_callbacks = _ListOnFirstUse()
    _lists = False
    """Whether either list was made (read through ``fut.__dict__`` instead, each future would
    get a dict)."""

    def __init__(self, condition: threading.Condition, hurry: Optional[Callable[[], ContextManager]] = None) -> None:  # noqa: D107
        self._condition = condition
        self._hurry = hurry
        self._state = PENDING
        self._result: Any = None
        self._exception: Optional[BaseException] = None

    def done(self) -> bool:
        return self._state in _OVER

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def result(self, timeout: Optional[float] = None) -> Any:
        if self._state == FINISHED and self._exception is None:  # set before the state, under the GIL
            return self._result
        self._wait(timeout)
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if self._state == FINISHED:
            return self._exception
        self._wait(timeout)
        return self._exception

    def _wait(self, timeout: Optional[float]) -> None:
        """Until finished (``CancelledError`` if cancelled, ``TimeoutError`` after ``timeout``),
        within ``hurry()`` where the batch has one (whoever resolves it then does so at once)."""
        if self._hurry is not None and self._state not in _OVER:
            with self._hurry():
                self._wait_over(timeout)
        else:
            self._wait_over(timeout)

    def _wait_over(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._state not in _OVER:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError()
                self._condition.wait(left)
            if self._state in _CANCELLED:
                raise CancelledError()


def batch_futures(n: int, hurry: Optional[Callable[[], ContextManager]] = None) -> list[PageFuture]:
    """``n`` pending futures sharing one condition (and ``hurry``: see ``PageFuture._wait``)."""
    condition = threading.Condition()
    return [PageFuture(condition, hurry) for _ in range(n)]


def resolve_many(futures: Sequence[PageFuture], results: Optional[Sequence[Any]], error: Optional[BaseException]) -> None:
    """Finish each of ``futures`` (one batch's, each running: ``set_running_or_notify_cancel``
    returned True) with ``results[k]``, or all with ``error``: one lock acquisition and one
    wake-up for the lot, then each one's callbacks, as ``set_result`` would run them."""
    if not futures:
        return
    condition = futures[0]._condition
    with condition:
        for k, fut in enumerate(futures):
            if error is not None:
                fut._exception = error
            else:
                fut._result = results[k]  # type: ignore[index]
            fut._state = FINISHED
            for waiter in (fut._waiters if fut._lists else ()):  # not made here where nobody waits
                if error is not None:
                    waiter.add_exception(fut)
                else:
                    waiter.add_result(fut)
        condition.notify_all()
    for fut in futures:
        if fut._lists and fut._done_callbacks:
            fut._invoke_callbacks()
