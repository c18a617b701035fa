"""The command loop of the peer drivers (``vllm_fs_driver.py``, ``lmcache_disk_driver.py``).

Imported by those scripts as a sibling module (they run as plain scripts in a peer's virtualenv,
where gdskv is not installed): one JSON line ``{"ready": true}`` (or ``{"error": ...}`` when the
driver cannot be made), then one answer line per command line until ``quit``.
"""
from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable


def serve(make_driver: Callable[[], Any], what: str) -> None:
    """Make the driver and answer commands ``{"op": name, **args}`` with ``driver.name(**args)``."""
    try:
        driver = make_driver()
    except Exception as exc:  # the peer is missing or changed: the bench prints this as the reason
        print(json.dumps({"error": f"cannot drive {what}: {exc!r}"}), flush=True)
        return
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
