"""Which Python MAX's model worker runs: imports nothing of MAX, so it can run before MAX loads."""
from __future__ import annotations

import os
import sys


def workers_run_this_python() -> None:
    """Put this interpreter's directory first on ``PATH``, before MAX is first imported. MAX's
    Mojo runtime, as it loads, takes the first ``python3`` on ``PATH`` as the interpreter (it
    sets ``PYTHONEXECUTABLE``), and the model worker MAX spawns starts as that one: run from a
    virtualenv that is not activated, that was a Python without this virtualenv's packages, and
    the worker died importing gdskv (``gdskv prewarm --engine max``: "MAX's engine did not
    start"). Called by that runner and by the launcher (``gdskv.connectors.max.launch``)."""
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if here and path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = f"{here}{os.pathsep}{path}" if path else here
