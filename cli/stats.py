"""``gdskv stats``: the counters every process on the store persisted, summed per namespace.

Each process that transfers pages writes ``<root>/.gdskv/stats/<host>-<pid>-<start>.json``
(``{"updated": t, "namespaces": {ns_id: {counter: n}}}``, see ``PageStore.flush_stats``); this sums
them all, so the figures cover every process that ever used the store. ``--prometheus`` prints
them in Prometheus's text format (``gdskv.metrics.families``, the names a serving process's
``/metrics`` uses), with the store's size and free space: a cron job can write that to a node
exporter's textfile collector directory.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

import click
from rich.table import Table

from gdskv import jsondoc
from gdskv.cli._common import UsageProblem, human_bytes, open_existing, print_json
from gdskv.cli.output import console as make_console
from gdskv.cli.plots import need_matplotlib, plot_stats
from gdskv.store import PRIVATE_DIR, PageStore


def summed(store: PageStore, history: Optional[list[tuple[float, dict[str, Counter[str]]]]] = None) -> dict[str, Any]:
    """``{"processes": n, "unreadable": [...], "namespaces": {ns_id: {counter: total}}}``; with
    ``history``, each file's ``(last updated, counters per namespace)`` is appended to it."""
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
            data = jsondoc.loads(store.fs.read_small(f"{rel}/{e.name}"))
            part = {ns_id: Counter({str(k): int(v) for k, v in counters.items()}) for ns_id, counters in data["namespaces"].items()}
            updated = float(data.get("updated") or 0.0)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, OverflowError):
            unreadable.append(e.name)
            continue
        processes += 1
        if history is not None:
            history.append((updated, part))
        for ns_id, counters in part.items():
            per_ns.setdefault(ns_id, Counter()).update(counters)
    return {"processes": processes, "unreadable": unreadable, "namespaces": {k: dict(sorted(v.items())) for k, v in sorted(per_ns.items())}}


def prometheus_text(store: PageStore, rep: dict[str, Any]) -> str:
    """The summed counters, the store's size and its file system's space in Prometheus's text
    exposition format (labels: namespace, model, tp_rank)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gdskv.eviction import disk_usage, scan_store
    from gdskv.metrics import Labels, counter_families, store_gauges

    specs = {ns.id: ns.spec for ns in store.namespaces()}
    rows = [(Labels(ns_id, specs[ns_id].model if ns_id in specs else "unknown", specs[ns_id].tp_rank if ns_id in specs else 0), counters)
            for ns_id, counters in rep["namespaces"].items()]
    table = scan_store(store, with_parents=False)
    total, free = disk_usage(str(store.root))
    families = counter_families(rows) + store_gauges(table.total_bytes, free, total, len(table))

    class _Families:
        def collect(self) -> Any:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return generate_latest(registry).decode()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the sums as JSON.")
@click.option("--prometheus", is_flag=True, help="Print the sums in Prometheus's text format (for a node exporter's textfile collector).")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw the token hit rate and bytes read/written over time to this PNG (needs pip install 'gdskv[plot]').")
@click.option("--remote", is_flag=True, help="The bucket of [gdskv.remote]: chunks per namespace and the remote-tier counters.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool, prometheus: bool, plot_path: Optional[str], remote: bool) -> None:
    """Hit, miss, byte, eviction, drop and corruption counters, per namespace, over all processes."""
    if as_json and prometheus:
        raise UsageProblem("--json and --prometheus are two formats: give one")
    if remote:
        if prometheus or plot_path is not None:
            raise UsageProblem("--remote shows the bucket's counts: give it without --prometheus or --plot")
        from gdskv.cli import _remote as remote_views  # the remote client only when asked for

        return remote_views.stats(ctx, as_json, summed)
    if plot_path is not None:
        need_matplotlib("--plot")
    _, store = open_existing(ctx)
    history: list[tuple[float, dict[str, Counter[str]]]] = []
    rep = summed(store, history)
    rep["models"] = {ns.id: ns.spec.model for ns in store.namespaces()}
    if plot_path is not None:
        points = plot_stats(history, rep["models"], plot_path)
        click.echo(f"plot of {points} points ({rep['processes']} process files) written to {plot_path}", err=True)
    if prometheus:
        click.echo(prometheus_text(store, rep), nl=False)
        return
    if as_json:
        print_json(rep)
        return
    for name in rep["unreadable"]:
        make_console(stderr=True).print(f"skipped unreadable stats file {name}", style="yellow")
    console = make_console()
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
