"""``gdskv``: inspect, verify, evict, gc and pre-warm a store; run the demo and the benchmark.

Exit codes: 0 ok, 1 something failed, 2 unusable input (a bad option, a path that is not a store).
Every error is one line on stderr; an unexpected one too (``-vv`` logs its traceback).
"""
from __future__ import annotations

import importlib
import os

import click

from gdskv.cli._common import OneLineErrors, finite
from gdskv.cli.progress import DEFAULT_EVERY, MAX_EVERY

# Each command's module is imported only when the command runs, so ``gdskv info``, a cron job's
# ``gdskv gc`` or ``gdskv --help`` never pays for torch and the engines. The summaries are each
# command's own first line (tests/test_cli.py holds them equal).
COMMANDS = {
    "info": "Store path, format, I/O engine, namespaces with chunk counts and bytes, budget and free space.",
    "ls": "Chunks with namespace, group, key prefix, size and last use, sorted by recency.",
    "stats": "Hit, miss, byte, eviction, drop and corruption counters, per namespace, over all processes.",
    "verify": "Re-check every chunk's checksum and key; exit 1 when any is bad.",
    "evict": "Remove least recently used chunks, deepest first.",
    "gc": "Remove temp files left by crashed writers and empty chunk directories.",
    "prewarm": "Prefill prompts from files through an engine with the connector, so their KV is stored.",
    "push": "Upload local chunks the remote lacks (create-only, verified first).",
    "pull": "Download remote chunks the local store lacks (verified, published atomically).",
    "bench": "Save/load GB/s of the store against raw sequential I/O and torch.save, on the store's disk.",
    "demo": "Round-trip KV through the store in new processes; serve a prompt prefix from it.",
}

# `gdskv prewarm --engine max`: MAX's model worker is a spawned process that re-imports this module
# with GDSKV_MAX_HOOK=1 (``gdskv.connectors.max.ENV_HOOK``); every other command never imports the
# MAX adapter.
if os.environ.get("GDSKV_MAX_HOOK") == "1":
    from gdskv.connectors.max import install_if_requested

    install_if_requested()


class Commands(OneLineErrors):
    """The ``gdskv`` group with its commands imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return getattr(importlib.import_module(f"gdskv.cli.{name}"), name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """``gdskv --help``'s command list, from ``COMMANDS`` rather than every command's module."""
        with formatter.section("Commands"):
            formatter.write_dl(list(COMMANDS.items()))


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_path", envvar="GDSKV_STORE", default=None, help="Store path (default: GDSKV_STORE, the config, or ~/.cache/gdskv/store).")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("--status-every", "status_every", type=click.FloatRange(min=0.05, max=MAX_EVERY), default=DEFAULT_EVERY,
              show_default=True, callback=finite,
              help="Seconds between progress lines when stderr is not a terminal (long prewarm, verify, evict, bench).")
@click.pass_context
def main(ctx: click.Context, store_path: str | None, verbose: int, status_every: float) -> None:
    """gdskv: a persistent KV-cache store for LLM serving."""
    import logging

    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)], format="%(levelname)s %(name)s: %(message)s")
    ctx.ensure_object(dict)
    ctx.obj["store_path"] = store_path
    ctx.obj["status_every"] = status_every


if __name__ == "__main__":
    main()
