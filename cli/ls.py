"""``gdskv ls``: the chunks of a store, most recently used first.

Chunks of namespaces whose metadata is damaged are listed too (they use space and ``evict`` may
remove them; they are never served), and each such namespace is named with what is wrong with it.
Exit codes: 0 listed, 1 the store could not be read, 2 usage.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import click
import numpy as np
from rich.table import Table

from gdskv.cli._common import human_age, human_bytes, open_existing, parse_duration, print_json
from gdskv.cli.output import console as make_console
from gdskv.cli.evict import selected_ids
from gdskv.eviction import read_trailer, scan_store


@click.command(name="ls")
@click.option("--namespace", "namespace", default=None, help="Namespace id (or a prefix of it) or model name.")
@click.option("--group", type=int, default=None, help="Layer group id.")
@click.option("--older-than", "older_than", default=None, help="Only chunks last used longer ago than this (e.g. 7d, 12h).")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True, help="Most rows to print (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--remote", is_flag=True, help="The objects in the bucket of [gdskv.remote] (--older-than does not apply).")
@click.pass_context
def ls(ctx: click.Context, namespace: Optional[str], group: Optional[int], older_than: Optional[str], limit: int, as_json: bool,
       remote: bool) -> None:
    """Chunks with namespace, group, key prefix, size and last use, sorted by recency."""
    if remote:
        from gdskv.cli import _remote as remote_views  # the remote client only when asked for

        return remote_views.ls(ctx, namespace, group, limit, as_json)
    try:
        _ls(ctx, namespace, group, older_than, limit, as_json)
    except (OSError, ValueError) as e:  # one line, never a traceback
        raise click.ClickException(f"ls: {e}") from None


def _ls(ctx: click.Context, namespace: Optional[str], group: Optional[int], older_than: Optional[str], limit: int, as_json: bool) -> None:
    _, store = open_existing(ctx)
    ids = selected_ids(store, namespace)
    table = scan_store(store, ids, with_parents=False)
    damaged = {ns_id: why for ns_id, why in store.damaged_namespaces() if ids is None or ns_id in ids}
    keep = np.ones(len(table), dtype=bool)
    if group is not None:
        group_of = np.array([a.group for a in table.arrays], dtype=np.int64)
        keep &= group_of[table.array] == group
    now = time.time_ns()
    if older_than is not None:
        keep &= table.mtime_ns < now - int(parse_duration(older_than) * 1e9)
    rows = np.nonzero(keep)[0]
    rows = rows[np.argsort(-table.mtime_ns[rows], kind="stable")]
    total = int(rows.size)
    if limit > 0:
        rows = rows[:limit]
    out: list[dict[str, Any]] = []
    for r in rows.tolist():
        ref = table.arrays[int(table.array[r])]
        path = table.path(r)
        t = read_trailer(store, ref.chunk_rel(int(table.index[r])))
        out.append({
            "namespace": ref.ns_id, "group": ref.group, "path": path,
            "key": t.block_key.hex() if t else None, "parent": t.parent_key.hex() if t and t.parent_key else None,
            "bytes": int(table.nbytes[r]), "mtime_ns": int(table.mtime_ns[r]),
            "damaged_namespace": ref.namespace is None,
        })
    if as_json:
        print_json({"total": total, "chunks": out, "damaged_namespaces": damaged})
        return
    t = Table(title=f"{len(out)} of {total} chunks, most recent first")
    for col in ("namespace", "group", "key", "parent", "size", "last use"):
        t.add_column(col, justify="right" if col in ("group", "size") else "left")
    for row in out:
        t.add_row(row["namespace"] + (" (damaged)" if row["damaged_namespace"] else ""), str(row["group"]),
                  (row["key"] or "(bad trailer)")[:16], (row["parent"] or "-")[:16], human_bytes(row["bytes"]), human_age(row["mtime_ns"], now))
    console = make_console()
    console.print(t)
    for ns_id, why in damaged.items():
        console.print(f"namespace {ns_id}: damaged metadata ({why}); its chunks are listed and evictable, never served", highlight=False)
