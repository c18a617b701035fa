"""The command loop of the peer drivers (``vllm_fs_driver.py``, ``lmcache_disk_driver.py``).

Imported by those scripts as a sibling module (they run as plain scripts in a peer's virtualenv,
where gdskv is not installed): one JSON line ``{"ready": true}`` (or ``{"error": ...}`` when the
driver cannot be made), then one answer line per command line until ``quit``. A driver whose
bench is gone (killed) exits by itself, whatever it is doing (``_exit_when_orphaned``), and one
that is done exits without waiting for threads its peer library left running.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable


ORPHAN_CHECK_SECONDS = 0.5


def _exit_when_orphaned(parent: int) -> None:
    """Exit the process once its parent (the bench) is gone, checked every
    ``ORPHAN_CHECK_SECONDS``: a bench killed outright must not leave its peer saving gigabytes."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_SECONDS)
    os._exit(1)


def serve(make_driver: Callable[[], Any], what: str) -> None:
    """Make the driver and answer commands ``{"op": name, **args}`` with ``driver.name(**args)``;
    exit the process at ``quit`` or the end of input."""
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), name="orphan-check", daemon=True).start()
    try:
        driver = make_driver()
    except Exception as exc:  # the peer is missing or changed: the bench prints this as the reason
        print(json.dumps({"error": f"cannot drive {what}: {exc!r}"}), flush=True)
        os._exit(0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            print(json.dumps({"ok": True, **getattr(driver, op)(**cmd)}), flush=True)
        except Exception as exc:
            traceback.print_exc()
            print(json.dumps({"error": f"{op}: {exc!r}"}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
