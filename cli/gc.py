"""``gdskv gc``: remove what crashed processes left behind, safely while others use the store.

Removes exactly two kinds of things:

- temporary files (``<name>.tmp.<pid>[.<rand>]``: unfinished chunk writes beside their chunk,
  unfinished stats and index files under ``.gdskv/``) whose writer is gone: the pid is not alive on
  this host and the file has not changed for ``--min-age``, or — whatever the pid (another host on
  a shared file system, a reused pid) — the file has not changed for ``--grace``;
- empty chunk directories under an array's ``c/`` not changed for ``--min-age`` (a writer creates
  its directory just before it writes; ``rmdir`` never removes a directory that has a file).

Nothing else is touched: no published chunk, no metadata, no quarantine. Exit 1 when a removal
failed (a read-only store: the count says why), 2 for a path that is not a store.
"""
from __future__ import annotations

from dataclasses import asdict

import click

from gdskv.cli._common import failures_logged, human_bytes, open_existing, parse_duration, print_json
from gdskv.cli.output import console as make_console
from gdskv.garbage import Collected, collect, find_garbage


@click.command()
@click.option("--grace", default="1h", show_default=True, help="Temp files older than this go whatever their pid.")
@click.option("--min-age", "min_age", default="60s", show_default=True, help="Nothing younger than this goes.")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def gc(ctx: click.Context, grace: str, min_age: str, dry_run: bool, as_json: bool) -> None:
    """Remove temp files left by crashed writers and empty chunk directories."""
    _, store = open_existing(ctx)
    garbage = find_garbage(store, parse_duration(min_age), parse_duration(grace))
    with failures_logged("gdskv.garbage") as failures:
        done = Collected() if dry_run else collect(store, garbage)
    rep = {"dry_run": dry_run, "temp_files": [p for p, _ in garbage.temp_files], "empty_dirs": garbage.empty_dirs, **asdict(done),
           "failure_reasons": dict(failures.reasons)}
    if as_json:
        print_json(rep)
        if done.failed:
            ctx.exit(1)
        return
    console = make_console()
    if dry_run:
        for p in rep["temp_files"] + rep["empty_dirs"]:
            console.print(f"would remove {p}")
        console.print(f"would remove {len(garbage.temp_files)} temp files and {len(garbage.empty_dirs)} empty directories")
    else:
        console.print(f"removed {done.removed_temp_files} of {len(garbage.temp_files)} temp files ({human_bytes(done.freed_bytes)}) and "
                      f"{done.removed_dirs} of {len(garbage.empty_dirs)} empty directories"
                      + (f"; {done.failed} failed: {failures.summary()}" if done.failed else ""))
        if done.failed:
            ctx.exit(1)
