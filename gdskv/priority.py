"""CPU priority of the threads that move pages nobody is waiting on yet.

Saves and asynchronous loads (a request held out of the batch until its prefix is in place) run
on transfer threads whose nice value is raised by ``GdsKvConfig.background_nice``: where the
engine's own threads keep the CPUs busy (a CPU engine, or a GPU server's scheduler and sampler
threads), those transfers take the CPU time the engine leaves instead of stretching its steps.
Loads a forward pass waits for keep the engine's priority. Nice values are per thread on Linux
and inherited by the native threads a transfer thread starts; elsewhere ``setpriority`` would
lower the whole process, so it is not applied there.

Called once per thread: as the ``ThreadPoolExecutor`` initializer of ``PageTransfer``'s
background pool, and by the remote tier's upload threads (``gdskv.remote.upload``) as they start.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

MAX_NICE = 19
_warn_once = threading.Lock()
_warned = False


def per_thread_nice() -> bool:
    """Whether ``setpriority(PRIO_PROCESS, 0, ...)`` changes only the calling thread (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def lower_this_thread(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (capped at 19). Never raises: a
    thread that cannot be lowered still transfers, at the engine's priority, and says so once."""
    if increment <= 0:
        return
    try:
        if not per_thread_nice():
            raise OSError("nice values are not per thread on this platform")
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(MAX_NICE, current + increment))
    except OSError as e:
        global _warned
        with _warn_once:
            if not _warned:
                _warned = True
                log.warning("gdskv: background transfers run at the engine's CPU priority (background_nice not "
                            "applied: %s)", e)
