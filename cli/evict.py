"""``gdskv evict``: bring a store under a byte budget, or drop what has not been used for a while.

Uses the same policy as the inline budget (``gdskv.eviction``): chunks go in increasing effective
recency (their own last use and every stored descendant's), deeper first, so a block never goes
while a descendant of it stays. Safe while servers use the store: a load that opened a chunk
before it was unlinked reads it whole; one that comes after finds it missing (a miss), and a chunk
a lookup leased meanwhile stays. Every array on disk is scanned, those of namespaces with damaged
metadata too. Exit codes: 0 done, 1 over budget afterwards or removals failed (or the store could
not be read), 2 usage.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional

import click
from rich.table import Table

from gdskv.cli._common import UsageProblem, failures_logged, human_bytes, open_existing, parse_duration, parse_size_or_percent, print_json
from gdskv.cli.output import console as make_console
from gdskv.cli.progress import Work, status_every
from gdskv.eviction import Limits, disk_usage, namespace_ids_matching, remove_chunks, scan_store, select_victims, shortfall
from gdskv.store import PageStore


def selected_ids(store: PageStore, wanted: Optional[str]) -> Optional[list[str]]:
    """``--namespace``: None for all, else the ids it matches (damaged namespaces included)."""
    if wanted is None:
        return None
    ids = namespace_ids_matching(store, wanted)
    if not ids:
        have = [ns.id for ns in store.namespaces()] + [i for i, _ in store.damaged_namespaces()]
        raise UsageProblem(f"no namespace matches {wanted!r} (have: {', '.join(have) or 'none'})")
    return ids


@click.command()
@click.option("--max-bytes", "max_bytes", default=None, help="Budget: a size (500G) or a share of the file system (10%).")
@click.option("--older-than", "older_than", default=None, help="Remove chunks not used (nor any descendant) for this long (7d, 12h).")
@click.option("--namespace", "namespace", default=None, help="Only this namespace (id, id prefix, or model); the budget then applies to it alone.")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def evict(ctx: click.Context, max_bytes: Optional[str], older_than: Optional[str], namespace: Optional[str], dry_run: bool, as_json: bool) -> None:
    """Remove least recently used chunks, deepest first. Without --max-bytes / --older-than, the
    config's max_bytes and free-space floor apply."""
    try:
        _evict(ctx, max_bytes, older_than, namespace, dry_run, as_json)
    except (OSError, ValueError) as e:  # one line, never a traceback
        raise click.ClickException(f"evict: {e}") from None


def _evict(ctx: click.Context, max_bytes: Optional[str], older_than: Optional[str], namespace: Optional[str], dry_run: bool, as_json: bool) -> None:
    cfg, store = open_existing(ctx)
    fs_total, fs_free = disk_usage(str(store.root))
    limit = parse_size_or_percent(max_bytes, fs_total) if max_bytes is not None else None
    age_s = parse_duration(older_than) if older_than is not None else None
    cutoff = time.time_ns() - int(age_s * 1e9) if age_s is not None else None
    limits = Limits(max_bytes=limit)
    if limit is None and cutoff is None:
        limits = Limits.of(cfg)
        if not limits.active:
            raise UsageProblem("nothing to evict against: give --max-bytes and/or --older-than, or set max_bytes / min_free_* in the config")
    with failures_logged("gdskv.eviction.index") as unsaved:  # a read-only store: one line, not one per array
        table = scan_store(store, selected_ids(store, namespace))
    if unsaved.reasons:
        make_console(stderr=True).print(f"evict: the eviction index could not be saved ({unsaved.summary()}); "
                                        "the next run reads every chunk's parent again")
    before = table.total_bytes
    now = time.time_ns()  # chunks a server's lookup leased to a pending load stay
    by_size = select_victims(table, shortfall(limits, before, fs_total, fs_free), now_ns=now)
    by_age = select_victims(table, None, older_than_ns=cutoff, now_ns=now) if cutoff is not None else by_size[:0]
    rows = by_size if by_size.size >= by_age.size else by_age  # both are prefixes of one ranking
    victim_bytes = int(table.nbytes[rows].sum())
    per_ns = Counter(table.arrays[int(table.array[r])].ns_id for r in rows.tolist())
    rep: dict[str, Any] = {"dry_run": dry_run, "chunks_before": len(table), "bytes_before": before, "max_bytes": limit,
                           "older_than_s": age_s,
                           "victims": int(rows.size), "victim_bytes": victim_bytes, "per_namespace": dict(per_ns)}
    freed = victim_bytes
    if not dry_run:
        def tried(_path: str) -> bool:  # called once per chunk it comes to: the progress
            work.advance()
            return False

        with failures_logged("gdskv.eviction.removal") as failures, Work("evict", int(rows.size), "chunks", status_every(ctx), bar=not as_json) as work:
            done = remove_chunks(store, table, rows, is_pinned=tried)
        store.flush_stats()
        freed = done.freed_bytes
        rep |= {"removed": done.removed, "removed_bytes": done.removed_bytes, "already_gone": done.already_gone, "failed": done.failed,
                "kept_pinned": done.skipped_pinned, "kept_leased": done.skipped_leased,
                "failure_reasons": dict(failures.reasons)}
    rep["bytes_after"] = before - freed
    rep["within_budget"] = limit is None or rep["bytes_after"] <= limit
    if as_json:
        print_json(rep)
    else:
        console = make_console()
        if dry_run and rows.size:
            t = Table(title=f"would remove (first {min(20, rows.size)} of {rows.size}, in order)")
            for col in ("namespace", "group", "path", "size"):
                t.add_column(col)
            for r in rows[:20].tolist():
                ref = table.arrays[int(table.array[r])]
                t.add_row(ref.ns_id, str(ref.group), table.path(r), human_bytes(int(table.nbytes[r])))
            console.print(t)
        if dry_run:
            head = f"would remove {rows.size} of {len(table)} chunks ({human_bytes(victim_bytes)} of {human_bytes(before)})"
        else:
            head = f"removed {rep['removed']} of {len(table)} chunks ({human_bytes(rep['removed_bytes'])} of {human_bytes(before)})"
            why = failures.summary()
            notes = [f"{n} {what}" for n, what in ((rep["failed"], "failed" + (f": {why}" if why else "")), (rep["already_gone"], "already gone"),
                                                   (rep["kept_leased"], "kept (leased meanwhile)"), (rep["kept_pinned"], "kept (pinned)")) if n]
            if notes:
                head += f" of {rows.size} chosen; " + ", ".join(notes)
        console.print(f"{head}; {human_bytes(rep['bytes_after'])} {'would remain' if dry_run else 'remain'}"
                      + (f"; budget {human_bytes(limit)}" if limit is not None else ""), highlight=False)
    if not rep["within_budget"] or rep.get("failed"):
        ctx.exit(1)
