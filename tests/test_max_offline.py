"""``gdskv.connectors.max.offline``: waiting on MAX's offline engine never outlives the engine.

MAX itself runs in ``tests/test_max_integration.py`` (an engine that cannot start: prewarm ends
with one line); here the wait's own rules, with real threads and no MAX."""
from __future__ import annotations

import threading
import time

import pytest

from gdskv.connectors.max.offline import EngineStopped, Watch, answer_unless_stopped


def test_an_answer_is_returned_and_an_error_raised_as_the_call_gave_them():
    watch = Watch()
    assert answer_unless_stopped(lambda: ["text"], watch) == ["text"]

    def fails() -> list[str]:
        raise ValueError("prompt too long for the model")

    with pytest.raises(ValueError, match="too long"):
        answer_unless_stopped(fails, watch)


def test_a_call_that_would_wait_forever_fails_once_the_engine_ended():
    """The engine thread ends (here: after 0.3 s, with its error) while the call waits for an
    answer nobody will give: EngineStopped naming that error, a poll or two later."""
    watch, never = Watch(), threading.Event()

    def engine_dies() -> None:
        time.sleep(0.3)
        watch.error = RuntimeError("SubprocessExit: worker killed")
        watch.ended.set()

    threading.Thread(target=engine_dies, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(EngineStopped, match="RuntimeError: SubprocessExit: worker killed"):
        answer_unless_stopped(lambda: never.wait(30), watch, poll=0.1)
    assert 0.3 <= time.monotonic() - start < 5


def test_an_answer_given_as_the_engine_ends_is_kept():
    """An engine that ended while its answer was on the way (it comes a little after the first
    poll saw the end): the answer, not EngineStopped."""
    watch = Watch()
    watch.ended.set()

    def slow() -> str:
        time.sleep(1.2)
        return "answered"

    assert answer_unless_stopped(slow, watch, poll=1.0) == "answered"
