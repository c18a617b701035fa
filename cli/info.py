"""``gdskv info``: what a store holds and what this machine would use to move it.

Namespaces whose metadata is damaged (missing, malformed, or not hashing to their directory's
name) are listed with what is wrong and the chunks they still hold. Exit codes: 0 reported, 1 the
store could not be read, 2 usage.
"""
from __future__ import annotations

from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from gdskv.cli._common import human_bytes, open_existing, print_json
from gdskv.cli.output import console as make_console
from gdskv.eviction import Limits, catalog, disk_usage, rebuild_catalog, scan_store
from gdskv.io import batch as batchio
from gdskv.io import engine_choice, make_engine
from gdskv.io.capabilities import cuda_driver_present, kvikio_available
from gdskv.store import PageStore


def chunk_counts(store: PageStore) -> dict[tuple[str, int], tuple[int, int]]:
    """``{(ns_id, group): (chunks, bytes)}`` of every array on disk (damaged namespaces' too),
    from the chunk index (``gdskv.eviction.catalog``); a store without one is walked once and
    the walk kept as its index."""
    try:
        return catalog.totals(store).per_array
    except catalog.CatalogMissing:
        if rebuild_catalog(store):
            return catalog.totals(store).per_array
    table = scan_store(store, with_parents=False)  # another process is indexing it right now
    out = {}
    for i, ref in enumerate(table.arrays):
        sel = table.array == i
        out[(ref.ns_id, ref.group)] = (int(sel.sum()), int(table.nbytes[sel].sum()))
    return out


def gather(ctx: click.Context) -> dict[str, Any]:
    """The report ``info`` prints (also its ``--json``)."""
    cfg, store = open_existing(ctx)
    if engine_choice(cfg) == "posix":  # nothing to probe: no engine (and no torch) needed
        engine_info = {"configured": cfg.engine, "selected": "posix", "describe": "posix (GDS inactive)", "gds_active": False}
    else:
        engine = make_engine(cfg)
        try:
            engine_info = {"configured": cfg.engine, "selected": engine.name, "describe": engine.describe(), "gds_active": engine.gds_active}
        finally:
            engine.close()
    engine_info |= {"kvikio_installed": kvikio_available(), "cuda_driver": cuda_driver_present()}
    on_disk = store.namespaces()
    per_array = chunk_counts(store)
    namespaces = []
    for ns in on_disk:
        s = ns.spec
        groups = []
        for g in s.groups:
            chunks, nbytes = per_array.get((ns.id, g.layer_group_id), (0, 0))
            groups.append({"group": g.layer_group_id, "window": g.window_size, "page_bytes": g.bytes_per_page,
                           "layers": list(g.layer_ids), "chunks": chunks, "bytes": nbytes})
        namespaces.append({"id": ns.id, "model": s.model, "dtype": s.dtype, "tokens_per_block": s.tokens_per_block,
                           "tp_rank": s.tp_rank, "tp_size": s.tp_size, "groups": groups})
    for ns_id, why in store.damaged_namespaces():
        groups = [{"group": gid, "window": None, "page_bytes": None, "layers": [], "chunks": n, "bytes": b}
                  for (i, gid), (n, b) in sorted(per_array.items()) if i == ns_id]
        namespaces.append({"id": ns_id, "damaged": why, "model": None, "dtype": None, "tokens_per_block": None,
                           "tp_rank": None, "tp_size": None, "groups": groups})
    total, free = disk_usage(str(store.root))
    limits = Limits.of(cfg)
    try:  # the store's own metadata file: direct I/O is a property of regular files
        dio = batchio.dio_alignment(str(store.root / "zarr.json"))
    except OSError:
        dio = None
    return {
        "store": str(store.root),
        "format_version": store.attributes().get("format_version"),
        "engine": engine_info,
        "direct_io": None if dio is None else {"memory_align": dio.memory, "offset_align": dio.offset,
                                               "in_place_align": dio.in_place},
        "namespaces": namespaces,
        "chunks": sum(n for n, _ in per_array.values()),
        "bytes": sum(b for _, b in per_array.values()),
        "budget": {"max_bytes": cfg.max_bytes, "min_free_bytes": cfg.min_free_bytes, "min_free_percent": cfg.min_free_percent,
                   "floor_bytes": limits.floor_bytes(total) if limits.active else None},
        "filesystem": {"total_bytes": total, "free_bytes": free},
    }


def direct_io_line(d: Any) -> str:
    """What the store's file system asks of direct I/O, as ``info`` prints it (``gather``'s
    ``direct_io``): which page memory the native reads and writes move in place."""
    if d is None:
        return "alignment not known (no statx answer, or no native path): pages on 4 KiB boundaries move in place, others are staged"
    if not d["offset_align"]:
        return "not supported on this file system: chunks go through the page cache"
    return (f"pages at {d['in_place_align']}-byte-aligned addresses move in place (O_DIRECT); others through an "
            "aligned staging copy")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--remote", is_flag=True, help="The bucket of [gdskv.remote] instead of the local store.")
@click.pass_context
def info(ctx: click.Context, as_json: bool, remote: bool) -> None:
    """Store path, format, I/O engine, namespaces with chunk counts and bytes, budget and free space."""
    if remote:
        from gdskv.cli import _remote as remote_views  # the remote client only when asked for

        return remote_views.info(ctx, as_json)
    try:
        rep = gather(ctx)
    except (OSError, ValueError) as e:  # one line, never a traceback
        raise click.ClickException(f"info: {e}") from None
    if as_json:
        print_json(rep)
        return
    console = make_console()
    e = rep["engine"]
    console.print(f"[bold]store[/]   {escape(rep['store'])}  (format v{rep['format_version']})", markup=True)
    console.print(f"[bold]engine[/]  {escape(e['describe'])}  (config: {escape(e['configured'])}; kvikio {'installed' if e['kvikio_installed'] else 'not installed'}; "
                  f"CUDA driver {'present' if e['cuda_driver'] else 'absent'})", markup=True)
    console.print(f"[bold]direct[/]  {escape(direct_io_line(rep['direct_io']))}", markup=True)
    b, fs = rep["budget"], rep["filesystem"]
    limits = []
    if b["max_bytes"] is not None:
        limits.append(f"max {human_bytes(b['max_bytes'])}")
    if b["floor_bytes"] is not None and (b["min_free_bytes"] is not None or b["min_free_percent"] is not None):
        limits.append(f"keep {human_bytes(b['floor_bytes'])} free")
    console.print(f"[bold]size[/]    {rep['chunks']} chunks, {human_bytes(rep['bytes'])}; budget: {', '.join(limits) or 'none'}; "
                  f"file system {human_bytes(fs['free_bytes'])} free of {human_bytes(fs['total_bytes'])}", markup=True)
    t = Table(title="namespaces")
    for col in ("namespace", "model", "dtype", "tokens/block", "TP", "group", "window", "page bytes", "layers", "chunks", "bytes"):
        t.add_column(col, justify="right" if col in ("tokens/block", "page bytes", "layers", "chunks", "bytes") else "left")
    for ns in rep["namespaces"]:
        if ns.get("damaged"):
            for i, g in enumerate(ns["groups"] or [{"group": "-", "chunks": 0, "bytes": 0}]):
                head = [ns["id"], f"(damaged: {ns['damaged']})", "", "", ""] if i == 0 else [""] * 5
                t.add_row(*head, str(g["group"]), "", "", "", str(g["chunks"]), human_bytes(g["bytes"]))
            continue
        for i, g in enumerate(ns["groups"]):
            head = [ns["id"], ns["model"], ns["dtype"], str(ns["tokens_per_block"]), f"{ns['tp_rank']}/{ns['tp_size']}"] if i == 0 else [""] * 5
            t.add_row(*head, str(g["group"]), "full" if g["window"] is None else str(g["window"]), str(g["page_bytes"]),
                      str(len(g["layers"])), str(g["chunks"]), human_bytes(g["bytes"]))
    console.print(t)
