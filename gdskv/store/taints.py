"""``TaintBoard``: requests whose load failed on some TP rank, told to ranks in other processes.

An engine without a hook to recompute a request whose load failed (TensorRT-LLM) runs it on, and
what it computes from then on stands on KV that is not its own, on every rank: under tensor
parallelism each rank's later KV depends on every rank's heads. The ranks of one process learn of
a failure through ``gdskv.connectors.trtllm.deployment.Peers``; ranks in separate processes (MPI)
on the machine that holds the store learn of it here: the failing rank leaves an empty file
``.gdskv/taint/<deployment>.<request id>`` (``deployment``: a nonce the scheduler puts in every
step's metadata, so engines sharing the store never mix their request ids), and every rank lists
the directory before it posts saves. The marker goes when the request finishes. Markers a crashed
engine left behind are swept once they are a day old.
"""
from __future__ import annotations

import logging
import os
import re
import time

from gdskv.confined import ConfinedDir
from gdskv.store.tree import PRIVATE_DIR

log = logging.getLogger(__name__)

TAINT_DIR = f"{PRIVATE_DIR}/taint"
STALE_SECONDS = 86400.0
"""Markers older than this belong to an engine that is gone (a request runs for minutes)."""
_DEPLOYMENT = re.compile(r"[0-9a-f]{16}")


def deployment_nonce() -> str:
    """A fresh deployment id (the TensorRT-LLM scheduler's, made once at its construction)."""
    return os.urandom(8).hex()


class TaintBoard:
    """The markers of one store. Best effort: a store that cannot take a marker (read-only, full)
    is logged once and the failure stays known to this process only. Thread-safe (each call is
    one or two system calls on the store's directory)."""

    def __init__(self, fs: ConfinedDir) -> None:
        self._fs = fs
        self._warned = False

    def mark(self, deployment: str, request_id: int) -> None:
        """``request_id`` of ``deployment`` failed a load on this rank (its worker, as it finds out)."""
        if not _DEPLOYMENT.fullmatch(deployment):
            return
        try:
            self._fs.makedirs(TAINT_DIR)
            os.close(self._fs.open(f"{TAINT_DIR}/{deployment}.{int(request_id)}", os.O_CREAT | os.O_WRONLY))
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("gdskv: could not tell other processes' ranks of a failed load (%s); "
                            "ranks in other processes may save what that request computes", e)

    def marked(self, deployment: str) -> set[int]:
        """The request ids of ``deployment`` some rank marked (a worker, before it posts saves)."""
        prefix = f"{deployment}."
        out = set()
        for e in self._fs.scandir(TAINT_DIR):
            rid = e.name[len(prefix):]
            if e.name.startswith(prefix) and rid.isascii() and rid.isdigit():
                out.add(int(rid))
        return out

    def clear(self, deployment: str, request_id: int) -> None:
        """``request_id`` finished (or is recomputed from scratch): its marker goes, if any."""
        if not _DEPLOYMENT.fullmatch(deployment):
            return
        try:
            self._fs.unlink(f"{TAINT_DIR}/{deployment}.{int(request_id)}")
        except OSError:
            pass

    def sweep(self, now: float | None = None) -> int:
        """Remove markers at least ``STALE_SECONDS`` old (or dated more than an hour ahead); the
        number removed. Called once per process, when a worker first binds a deployment."""
        now = time.time() if now is None else now
        removed = 0
        for e in self._fs.scandir(TAINT_DIR, with_stat=True):
            if e.kind != "file" or e.st is None:
                continue
            age = now - e.st.st_mtime
            if age >= STALE_SECONDS or age < -3600:
                try:
                    self._fs.unlink(f"{TAINT_DIR}/{e.name}")
                    removed += 1
                except OSError:
                    pass
        return removed
