"""The ``max`` CLI with gdskv's KVConnector installed: ``python -m gdskv.connectors.max.launch``
(also ``python -m gdskv.connectors.max_launch`` and the ``gdskv-max`` console script).

    python -m gdskv.connectors.max_launch generate --model-path MODEL --devices cpu \\
        --kv-connector-config '{"type":"rust_tiered"}' --prompt "..."
    python -m gdskv.connectors.max_launch serve --model-path MODEL \\
        --kv-connector-config '{"type":"rust_tiered"}'

Everything after the module name is passed to MAX's CLI unchanged. Run as a program, it first
lets MAX re-execute the interpreter with jemalloc (as the ``max`` command does), before anything
heavy is imported, so the re-executed process is the only one that pays for the imports.
Importing this module calls ``gdskv.connectors.max.install()``: ``max serve`` starts its model
worker with multiprocessing's ``spawn``, which re-imports the parent's main module (this one, or
the shim that imports it) in the worker, so the worker's cache manager gets the hook as well,
with no ``.pth`` file. The store comes from gdskv's config (``GDSKV_CONFIG`` / ``GDSKV_STORE``);
when the config has no ``model_id``, ``main`` sets ``GDSKV_MAX_MODEL`` from ``--model-path`` /
``--model`` for this process and its workers. Where MAX is not installed, every invocation
(``--help`` too) is one line on stderr and exit 2.
"""
from __future__ import annotations

import importlib.util
import os
import sys

MISSING = "gdskv-max runs Modular MAX's CLI with gdskv's connector, and MAX is not installed in this Python (see docs/max.md)"
HAS_MAX = importlib.util.find_spec("max") is not None

if HAS_MAX:
    from gdskv.connectors.max.interpreter import workers_run_this_python

    workers_run_this_python()  # before MAX loads: its runtime picks the workers' Python then

if __name__ == "__main__" and HAS_MAX:
    from max._entrypoints.allocator import reexec_with_jemalloc

    reexec_with_jemalloc()

if HAS_MAX:
    from gdskv.connectors.max.wiring import ENV_MODEL, install, model_from_argv  # (after the re-exec)

    install()


def main() -> None:
    """Run MAX's CLI with the hook installed. Console entry point and ``-m`` target."""
    if not HAS_MAX:
        print(f"Error: {MISSING}", file=sys.stderr)
        sys.exit(2)
    model = model_from_argv(sys.argv[1:])
    if model is not None:
        os.environ.setdefault(ENV_MODEL, model)
    from max._entrypoints.pipelines import main as max_main

    sys.argv[0] = "max"
    sys.exit(max_main())


if __name__ == "__main__":
    main()
