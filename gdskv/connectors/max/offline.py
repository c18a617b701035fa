"""MAX's offline ``LLM`` for ``gdskv prewarm --engine max``, failing where MAX 26.7 would wait.

``max._entrypoints.llm.LLM`` runs its engine (the pipeline and the model worker process it
spawns) on a thread of its own, and waits with no timeout for that thread to say it is ready and
for every answer. When the engine ends instead (a model worker that cannot start or dies, weights
that do not load), nothing ever answers and the caller hangs. ``OfflineLlm`` watches the engine
thread and raises ``EngineStopped`` as soon as it ended. MAX is imported only when one is made.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence, TypeVar

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
"""How often a wait looks at the engine thread."""

T = TypeVar("T")


class EngineStopped(RuntimeError):
    """MAX's engine thread ended while the caller waited for it (at start-up or for an answer)."""


class Watch:
    """The engine thread's end and the error it ended with, if any."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.error: Optional[BaseException] = None

    def why(self) -> str:
        if self.error is None:
            return "it ended without an error (stopped?)"
        text = " ".join(str(self.error).split()) or type(self.error).__name__
        return f"{type(self.error).__name__}: {text}"


class OfflineLlm:
    """One MAX ``LLM`` whose engine thread is watched. Made by ``_MaxRunner`` of
    ``gdskv.cli.prewarm`` once per run; ``generate`` per prompt; ``close`` stops the engine (MAX
    then stops its model worker: ``wiring`` makes that worker finish its offloads first)."""

    def __init__(self, pipeline_args: Any) -> None:
        from max._entrypoints import llm as max_llm

        self._watch = watch = Watch()
        engine = max_llm._run_async_worker

        def watched(pc: Any, *args: Any) -> None:
            try:
                engine(pc, *args)
            except BaseException as e:  # reported by the caller in one line, not as this thread's traceback
                log.debug("MAX's engine thread ended", exc_info=True)
                watch.error = e
            finally:
                watch.ended.set()
                pc.ready.set()  # LLM() waits for it with no timeout

        max_llm._run_async_worker = watched  # LLM() reads it when it starts the thread, below
        try:
            self._llm: Any = max_llm.LLM(pipeline_args)
        finally:
            max_llm._run_async_worker = engine
        if watch.ended.is_set():
            self._llm = None
            raise EngineStopped(f"MAX's engine did not start: {watch.why()}")

    def generate(self, prompts: Sequence[str], max_new_tokens: int) -> Sequence[str]:
        """MAX's ``LLM.generate``, on a thread of its own, raising ``EngineStopped`` instead of
        waiting when the engine ends before it answered."""
        if self._llm is None:
            raise EngineStopped("MAX's engine was closed")
        if self._watch.ended.is_set():
            raise EngineStopped(f"MAX's engine stopped: {self._watch.why()}")
        llm = self._llm
        return answer_unless_stopped(lambda: llm.generate(list(prompts), max_new_tokens=max_new_tokens, use_tqdm=False),
                                     self._watch)

    def close(self) -> None:
        """Stop the engine and wait for it (MAX's ``LLM.__del__``: its model worker is sent
        SIGTERM, then SIGKILL five seconds later). Idempotent."""
        llm, self._llm = self._llm, None
        del llm


def answer_unless_stopped(call: Callable[[], T], watch: Watch, poll: float = POLL_SECONDS) -> T:
    """``call()`` on a daemon thread of its own: what it returns or raises, or ``EngineStopped``
    once ``watch`` saw the engine end and ``call`` still had not answered ``poll`` seconds later
    (a call waiting for that engine would wait forever). Called by ``OfflineLlm.generate``."""
    done = threading.Event()
    result: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as e:
            result.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="gdskv-max-generate", daemon=True).start()
    while not done.wait(poll):
        if watch.ended.is_set() and not done.wait(poll):
            raise EngineStopped(f"MAX's engine stopped: {watch.why()}")
    ok, value = result[0]
    if not ok:
        raise value
    return value
