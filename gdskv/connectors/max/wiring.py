"""Wiring gdskv into MAX: the connector factory MAX's cache manager calls, the hook that makes it
call ours, and the model identity of the namespace.

MAX 26.7 has no plugin hook for third-party connectors, so ``install()`` replaces
``max.pipelines.kv_cache.paged_kv_cache.jenga_cache_manager.create_connector``. MAX is imported
only inside ``install``.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from gdskv import streams
from gdskv.config import ConfigError, GdsKvConfig, load_config
from gdskv.connectors.max.connector import GdsKvConnector
from gdskv.connectors.max.memory import page_tables
from gdskv.connectors.max.types import KVCacheGroupId

log = logging.getLogger(__name__)

ENV_MODEL = "GDSKV_MAX_MODEL"
"""Model identity for the namespace when the config has no ``model_id`` (the launcher sets it
from ``--model-path``)."""
ENV_METRICS = "GDSKV_MAX_METRICS"
"""When set, the connector's lifetime counters are kept in this JSON file (rewritten whenever a
transfer settles, and at shutdown)."""
ENV_HOOK = "GDSKV_MAX_HOOK"
"""Set to ``1`` by a process that installed the hook for MAX model workers it spawns; see
``install_if_requested``."""


def model_identity(cfg: GdsKvConfig) -> str:
    """The model part of the namespace: ``model_id`` from the config, else ``GDSKV_MAX_MODEL``.

    Raises ``ConfigError`` naming the setting when neither is set: KV must never be shared
    between models whose pages happen to have the same geometry."""
    model = cfg.model_id or os.environ.get(ENV_MODEL)
    if not model:
        raise ConfigError(f"gdskv config: model_id must be set for MAX (in the TOML named by GDSKV_CONFIG, "
                          f"or {ENV_MODEL}; python -m gdskv.connectors.max_launch sets it from --model-path)")
    return model


def model_from_argv(argv: Sequence[str]) -> Optional[str]:
    """The value of ``--model-path`` / ``--model`` in a MAX command line, or None. A local
    directory is made absolute, so the namespace does not depend on the working directory.
    Called by ``gdskv.connectors.max.launch``."""
    for i, arg in enumerate(argv):
        for flag in ("--model-path", "--model"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            return os.path.abspath(value) if os.path.isdir(value) else value
    return None


def create_gdskv_connector(leaves: Mapping[str, KVCacheGroupId], devices: Sequence[Any],
                           replica_kv_memory: Sequence[Mapping[str, Any]], params: Any,
                           device_memory_bytes: int) -> GdsKvConnector:
    """MAX's ``create_connector`` signature, building a ``GdsKvConnector`` from gdskv's config.

    Called by MAX's Jenga cache manager (through ``install()``) once, at bring-up."""
    cfg = load_config()
    algo = str(getattr(params, "kv_hash_algo", "ahash64"))
    seed = getattr(params, "kv_hash_seed", None)
    if algo == "sha256" and seed is None:
        log.warning("gdskv: --kv-cache-hash-algo sha256 without --kv-cache-hash-seed draws a random seed per "
                    "process, so no block stored by one process is ever found by another")
    extra = {
        "kv_hash_algo": algo,
        "kv_hash_seed": "none" if seed is None else hashlib.sha256(bytes(seed)).hexdigest()[:16],
        "num_layers": str(getattr(params, "num_layers", "")),
    }
    memory = [{leaf: page_tables(leaf, r, mem) for leaf, mem in replica.items() if leaf in leaves}
              for r, replica in enumerate(replica_kv_memory)]
    dtype = getattr(params.dtype, "name", str(params.dtype))
    connector = GdsKvConnector(leaves, memory, model=model_identity(cfg), dtype=dtype,
                               tokens_per_block=int(params.page_size), config=cfg, extra=extra,
                               stats_file=os.environ.get(ENV_METRICS), engine_streams=streams.engine_streams(devices))
    atexit.register(_shutdown_at_exit, connector)  # held to the end: MAX may drop it with offloads in flight
    _exit_on_sigterm_through_exit_handlers()
    return connector


def _shutdown_at_exit(connector: GdsKvConnector) -> None:
    """At interpreter exit: shut down a connector MAX did not (``max generate`` drops its
    pipeline and ends without calling the cache manager's ``shutdown``), so offloads still in
    flight are written and settled and the counters file holds them. A no-op after ``shutdown``."""
    try:
        connector.shutdown()
    except Exception as e:  # at exit nobody is left to handle it: say what was lost
        log.warning("gdskv: connector shutdown at exit failed: %s", e)


def _exit_on_sigterm_through_exit_handlers() -> None:
    """Make SIGTERM end this process through its exit handlers (``_shutdown_at_exit``), status 143.

    MAX stops a model worker with SIGTERM (SIGKILL five seconds later) and the worker keeps the
    signal's default action, which ends a process at once: offloads still being written would be
    lost, as ``gdskv prewarm --engine max`` found when it stopped its engine right after the last
    prompt. Installed only from the main thread and only over the default action (a process that
    handles SIGTERM itself keeps its handler). Python runs the handler on the main thread when
    that thread next runs Python code: a MAX model worker's scheduler loop does every 10 ms at
    most. Called by ``create_gdskv_connector``."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise SystemExit(128 + signum)


_installed: Optional[Callable[..., Any]] = None


def install() -> None:
    """Make MAX's Jenga cache manager use ``GdsKvConnector`` for any non-null connector type.

    MAX 26.7 has no plugin hook for third-party connectors, so this replaces
    ``max.pipelines.kv_cache.paged_kv_cache.jenga_cache_manager.create_connector``; MAX keeps
    the connector only when ``--kv-connector-config`` names a non-null type (use
    ``'{"type":"rust_tiered"}'``). With the null type MAX's own factory still runs. Idempotent.
    Called at import by ``gdskv.connectors.max.launch`` (so a spawned model worker gets it too),
    or by a script before it builds a MAX pipeline.
    """
    global _installed
    from max.nn.kv_cache.cache_params import KVConnectorType
    from max.pipelines.kv_cache.paged_kv_cache import jenga_cache_manager as jcm

    if _installed is not None and jcm.create_connector is _installed:
        return
    original = jcm.create_connector

    def create_connector(leaves: Any, devices: Any, replica_kv_memory: Any, params: Any, device_memory_bytes: int) -> Any:
        if params.kv_connector_config.type == KVConnectorType.null:
            return original(leaves, devices, replica_kv_memory, params, device_memory_bytes)
        return create_gdskv_connector(leaves, devices, replica_kv_memory, params, device_memory_bytes)

    jcm.create_connector = create_connector
    _installed = create_connector


def install_if_requested() -> None:
    """Install the hook when ``GDSKV_MAX_HOOK=1`` and MAX imports; otherwise do nothing.

    MAX's offline ``LLM`` runs the model in a worker started with ``spawn``, which re-imports the
    parent's main module; a main module that calls this at import (``gdskv.cli.main``) thus
    gives that worker the hook its parent installed (``gdskv prewarm --engine max``)."""
    if os.environ.get(ENV_HOOK) != "1":
        return
    try:
        install()
    except ImportError:
        log.warning("gdskv: %s=1 but MAX does not import here; no connector hook", ENV_HOOK)
