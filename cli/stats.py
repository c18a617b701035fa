"""``gdskv stats``: the counters every process on the store persisted, summed per namespace.

Each process that transfers pages writes ``<root>/.gdskv/stats/<host>-<pid>-<start>.json``
(``{"updated": t, "namespaces": {ns_id: {counter: n}}}``, see ``PageStore.flush_stats``); this sums
them all, so the figures cover every process that ever used the store.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from gdskv.cli import _remote as remote_views
from gdskv.cli._common import human_bytes, open_existing, print_json
from gdskv.store import PRIVATE_DIR, PageStore


def summed(store: PageStore) -> dict[str, Any]:
    """``{"processes": n, "unreadable": [...], "namespaces": {ns_id: {counter: total}}}``."""
    per_ns: dict[str, Counter[str]] = {}
    processes = 0
    unreadable = []
    rel = f"{PRIVATE_DIR}/stats"
    # through store.fs: a link or a FIFO among the files is unreadable, never followed or waited on;
    # a temp file ends ``.json.tmp.<pid>``: not taken
    for e in sorted(store.fs.scandir(rel), key=lambda e: e.name):
        if not e.name.endswith(".json"):
            continue
        try:
            data = json.loads(store.fs.read_small(f"{rel}/{e.name}"))
            part = {ns_id: Counter({str(k): int(v) for k, v in counters.items()}) for ns_id, counters in data["namespaces"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            unreadable.append(e.name)
            continue
        processes += 1
        for ns_id, counters in part.items():
            per_ns.setdefault(ns_id, Counter()).update(counters)
    return {"processes": processes, "unreadable": unreadable, "namespaces": {k: dict(sorted(v.items())) for k, v in sorted(per_ns.items())}}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the sums as JSON.")
@click.option("--remote", is_flag=True, help="The bucket of [gdskv.remote]: chunks per namespace and the remote-tier counters.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool, remote: bool) -> None:
    """Hit, miss, byte, eviction, drop and corruption counters, per namespace, over all processes."""
    if remote:
        return remote_views.stats(ctx, as_json, summed)
    _, store = open_existing(ctx)
    rep = summed(store)
    rep["models"] = {ns.id: ns.spec.model for ns in store.namespaces()}
    if as_json:
        print_json(rep)
        return
    console = Console()
    for name in rep["unreadable"]:
        console.print(f"[yellow]skipped unreadable stats file {name}[/]")
    if not rep["namespaces"]:
        console.print(f"no counters yet ({rep['processes']} process files)")
        return
    for ns_id, counters in rep["namespaces"].items():
        t = Table(title=f"namespace {ns_id} ({rep['models'].get(ns_id, 'unknown model')}), {rep['processes']} process files")
        t.add_column("counter")
        t.add_column("total", justify="right")
        for k, v in counters.items():
            t.add_row(k, human_bytes(v) if k.endswith("bytes") or k.startswith("bytes_") else str(v))
        hits, missing = counters.get("loads_hit", 0), counters.get("loads_missing", 0) + counters.get("loads_corrupt", 0)
        if hits + missing:
            t.add_row("load hit rate", f"{hits / (hits + missing):.1%}")
        console.print(t)
