"""Warnings that a wrong setting would repeat for every request, said once per spell.

A remote that refuses (credentials it does not know, a missing bucket, a permission) refuses
every read or upload; a serving node then says so once per ``retry_after``, names what to check,
and counts the rest (``remote_refused``, ``remote_upload_refused``), instead of a log line per page.

Called by ``gdskv.remote.tier.RemoteTier`` (refused reads) and ``gdskv.remote.upload.Uploader``
(refused uploads and listings).
"""
from __future__ import annotations

import threading
import time


class Throttle:
    """Whether a warning of one kind may be said now: at most once per ``every`` seconds."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._quiet_until = 0.0

    def ready(self) -> bool:
        """True at most once per ``every`` seconds (the caller then logs its warning)."""
        with self._lock:
            now = time.monotonic()
            if now < self._quiet_until:
                return False
            self._quiet_until = now + self.every
            return True
