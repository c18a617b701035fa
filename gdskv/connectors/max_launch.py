"""``python -m gdskv.connectors.max_launch``: the MAX launcher under the name command lines and
docs use; the launcher itself is ``gdskv.connectors.max.launch`` (see there). Run as a program, it
lets MAX re-execute the interpreter with jemalloc first, as the launcher does; importing it
installs the hook (a spawned MAX worker re-imports it)."""
from __future__ import annotations

import importlib.util

if __name__ == "__main__" and importlib.util.find_spec("max") is not None:
    from gdskv.connectors.max.interpreter import workers_run_this_python

    workers_run_this_python()  # before MAX loads: its runtime picks the workers' Python then
    from max._entrypoints.allocator import reexec_with_jemalloc

    reexec_with_jemalloc()

from gdskv.connectors.max.launch import main  # noqa: E402,F401  (installs the hook)

if __name__ == "__main__":
    main()
