"""``gdskv.futures``: a batch's page futures behave as ``concurrent.futures.Future`` does, though
they share one condition and are settled a slice at a time."""
from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, TimeoutError, as_completed, wait

import pytest

from gdskv.futures import batch_futures, resolve_many


def _running(n: int) -> list:
    futures = batch_futures(n)
    assert all(f.set_running_or_notify_cancel() for f in futures)
    return futures


def test_results_callbacks_and_waiters_as_a_future() -> None:
    futures = _running(3)
    seen: list[tuple[int, object]] = []
    futures[1].add_done_callback(lambda f: seen.append((1, f.result())))
    (done_before, _) = wait(futures, timeout=0)
    assert not done_before and not any(f.done() for f in futures)
    resolve_many(futures, ["a", "b", "c"], None)
    assert [f.result() for f in futures] == ["a", "b", "c"]
    assert all(isinstance(f, Future) and f.done() and f.exception() is None for f in futures)
    assert seen == [(1, "b")]
    futures[0].add_done_callback(lambda f: seen.append((0, f.result())))  # already done: runs at once
    assert seen[-1] == (0, "a")
    assert wait(futures, timeout=1).not_done == set()


def test_an_error_reaches_every_future_of_the_slice() -> None:
    futures = _running(2)
    resolve_many(futures, None, OSError("disk gone"))
    for f in futures:
        assert isinstance(f.exception(), OSError)
        with pytest.raises(OSError, match="disk gone"):
            f.result()


def test_a_waiter_is_not_woken_for_another_page_of_its_batch() -> None:
    """Resolving page 0 notifies the shared condition; page 1's waiter must keep waiting (the base
    class would take that wake-up for a timeout and raise TimeoutError)."""
    futures = _running(2)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(futures[1].result()))
    waiter.start()
    time.sleep(0.05)
    resolve_many(futures[:1], ["first"], None)
    time.sleep(0.05)
    assert waiter.is_alive() and not got
    resolve_many(futures[1:], ["second"], None)
    waiter.join(5)
    assert got == ["second"]


def test_timeouts_and_cancellation() -> None:
    futures = batch_futures(2)
    with pytest.raises(TimeoutError):
        futures[0].result(timeout=0.02)
    with pytest.raises(TimeoutError):
        futures[0].exception(timeout=0.02)
    assert futures[1].cancel() and futures[1].cancelled() and futures[1].done()
    assert not futures[1].set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        futures[1].result()
    assert futures[0].set_running_or_notify_cancel() and not futures[0].cancel()  # running: too late
    resolve_many(futures[:1], [7], None)
    assert futures[0].result(timeout=0) == 7


def test_waiters_in_wait_and_as_completed_are_woken_and_unwatched_futures_make_no_lists() -> None:
    """``concurrent.futures.wait``/``as_completed`` install their waiters in the lists a page
    future makes on first use, and ``resolve_many`` wakes them; a future nobody waits on or
    calls back from never makes those lists (they were two garbage-collected objects a page)."""
    futures = _running(3)
    woke: list[set] = []
    waiter = threading.Thread(target=lambda: woke.append(wait(futures, timeout=5, return_when=FIRST_COMPLETED).done))
    waiter.start()
    time.sleep(0.05)
    resolve_many(futures[1:2], ["b"], None)
    waiter.join(5)
    assert woke == [{futures[1]}]
    order: list[object] = []
    reader = threading.Thread(target=lambda: order.extend(f.result() for f in as_completed(futures[::2], timeout=5)))
    reader.start()
    time.sleep(0.05)
    resolve_many(futures[2:], ["c"], None)
    resolve_many(futures[:1], ["a"], None)
    reader.join(5)
    assert order == ["c", "a"]
    quiet = _running(2)
    resolve_many(quiet, [1, 2], None)
    assert [f.result() for f in quiet] == [1, 2] and not any(f._lists for f in quiet)
